"""Whether a verification's rows are a decode step's bit for bit, and where a CPU's own kernels say why not.

The graphs are built so that every matmul runs >= 2 rows in a decode step as in a verification (the fused
attention's spare row), except the head at decode (its S = 1 graph) and the lone-row stack. On the AVX-512 x86 hosts
of earlier sessions every kernel computed a row alike however many ran with it. On an AVX2-only AMD EPYC
(2026-11-27, onnxruntime 1.32) 4-bit MatMulNBits does not: a lone row (M = 1) is 2.4e-7 from the same row among
others in a standalone probe, and a tiny int4 export's verification rows are 1e-6 from its decode steps (amplified
to 2e-2 by a later layer in one), an 8-bit head or not; int8 and fp32 exports stay exact. The runtime measures it
(`rows_exact_here`), so `--speculative auto` stays off for greedy runs there. The tests assert exactness wherever
this CPU's 4-bit kernel is row-exact or the export has no 4-bit weight, and otherwise that the runtime's probe sees
the difference.
"""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgellm.runtime.speculative import rows_exact_here


@functools.cache
def four_bit_rows_exact() -> bool:
    """Whether this CPU's 4-bit MatMulNBits (accuracy level 4) computes a lone row bit for bit as the same row
    among others: one random [512, 256] weight, rows 0 of M = 1 and M = 2."""
    k, n, block = 256, 512, 32
    rng = np.random.default_rng(0)
    w = rng.integers(0, 255, size=(n, k // block, block // 2), dtype=np.uint8)
    scales = (rng.random(n * k // block) * 0.01 + 0.001).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [helper.make_tensor("w", TensorProto.UINT8, w.shape, w.tobytes(), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, scales.shape, scales)])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, k)).astype(np.float32)
    return bool(np.array_equal(session.run(None, {"x": x[:1]})[0], session.run(None, {"x": x})[0][:1]))


def has_4bit(engine) -> bool:
    """Whether the export behind `engine` holds 4-bit weights (the linears, or the int4 rows of a split head)."""
    weights = (engine.manifest.quantization or {}).get("weights") or {}
    return any(w.get("bits") == 4 for w in weights.values())


def assert_rows_exact(engine, rows: np.ndarray, steps: np.ndarray) -> bool:
    """rows == steps bit for bit (returns True); or (returns False), only on a CPU whose 4-bit kernel is not
    row-exact and for an export with 4-bit weights, a difference of rounding size that the runtime's probe
    reports too (so `--speculative auto` is off there)."""
    if np.array_equal(rows, steps):
        return True
    diff = float(np.abs(rows - steps).max())
    assert not four_bit_rows_exact() and has_4bit(engine), f"rows differ from decode steps by {diff:.3g}"
    assert rows_exact_here(engine)[0] is False, diff
    return False
