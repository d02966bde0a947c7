"""Scale rules and fp16 scales (quant/schemes.py, plan.py): each against its definition, on small weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgellm.quant.nbits_read import read_nbits
from edgellm.quant.schemes import Scheme, dequantize, fp16_exact, quant_error, quantize, with_fp16_scales
from edgellm.runtime.manifest import read_manifest
from tests.quant_helpers import export
from tests.quant_helpers import quantize as quantize_export


def grid_weight(n: int, k: int, bits: int, block: int, symmetric: bool, seed: int = 0) -> np.ndarray:
    """A weight whose every block lies on a `bits` grid with an fp16 scale and spans the grid's full range
    (llama.cpp Q8_0 blocks for (8, sym); an integer-zero-point asymmetric grid for (4, asym))."""
    rng = np.random.default_rng(seed)
    nb = k // block
    scale = rng.uniform(0.001, 0.02, (n, nb, 1)).astype(np.float16).astype(np.float32)
    if symmetric:
        q = rng.integers(-127, 128, (n, nb, block))
        q[..., 0] = 127 * rng.choice([-1, 1], (n, nb))     # max|q| = 127: the grid's scale is amax / 127
        return (q * scale).reshape(n, k).astype(np.float32)
    zp = rng.integers(1, (1 << bits) - 1, (n, nb, 1))
    q = rng.integers(0, 1 << bits, (n, nb, block))
    q[..., 0], q[..., 1] = 0, (1 << bits) - 1              # the block spans codes 0..15
    return ((q - zp) * scale).reshape(n, k).astype(np.float32)


def test_int8_g32_with_fp16_scales_recovers_a_q8_0_grid_exactly() -> None:
    w = grid_weight(16, 128, 8, 32, True)
    qw = with_fp16_scales(w, quantize(w, Scheme(8, 32, True)))
    assert fp16_exact(qw.scales) and np.array_equal(dequantize(qw), w)
    coarse = quantize(w, Scheme(8, 64, True))             # a 64-block mixes two grids: not exact
    assert quant_error(w, coarse).rel_rms_err > 1e-3


def test_asymmetric_int4_recovers_an_integer_zero_point_grid_exactly() -> None:
    w = grid_weight(8, 96, 4, 32, False)
    qw = with_fp16_scales(w, quantize(w, Scheme(4, 32, False)))
    assert np.allclose(dequantize(qw), w, rtol=0, atol=1e-6 * np.abs(w).max())
    assert quant_error(w, quantize(w, Scheme(4, 32, True))).rel_rms_err > 0.01   # symmetric cannot


def test_q4_0_rule_uses_sixteen_levels_and_beats_fifteen() -> None:
    w = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    qw = quantize(w, Scheme(4, 32, True))
    blocks = w.reshape(64, 8, 32)
    ext = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    assert np.allclose(qw.scales, ext / -8)               # llama.cpp Q4_0: d = w_ext / -8
    assert set(np.unique(qw.codes)) == set(range(16))
    # the old rule (s = max|w| / 7, codes 1..15): the same codes' error, larger
    s7 = np.abs(blocks).max(-1) / 7
    old = quantize(w, Scheme(4, 32, True), s7.astype(np.float32))
    assert quant_error(w, qw).rel_rms_err < 0.95 * quant_error(w, old).rel_rms_err


def test_fp16_scales_fall_back_when_a_scale_would_underflow() -> None:
    w = np.full((2, 32), 1e-9, np.float32)                # scale ~1e-10: zero in fp16
    qw = quantize(w, Scheme(8, 32, True))
    assert with_fp16_scales(w, qw) is qw


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return export(tmp_path_factory.mktemp("tied"), "from-scratch", "layer")


@pytest.mark.parametrize(("bits", "scales_dtype", "half"), [(4, "auto", False), (4, "float16", True),
                                                           (8, "auto", True), (8, "float32", False)])
def test_fast_export_stores_scales_as_asked_and_sizes_add_up(tied, tmp_path, bits: int, scales_dtype: str,
                                                              half: bool) -> None:
    """`--scales-dtype auto` stores 4-bit weights' scales float32, read by MatMulNBits directly, and 8-bit ones as a
    float16 initializer behind a Cast (float16 / float32: every weight so); the manifest's bytes per weight are its
    codes + 2 or 4 bytes per block (+ packed zero points). The values are fp16-rounded either way."""
    _, src = tied
    out = quantize_export(src, tmp_path / "q", bits=bits, scales_dtype=scales_dtype)

    weights = read_manifest(out).quantization["weights"]
    for f in sorted(out.glob("layer_*.onnx")):
        model = onnx.load(str(f))                          # external data from the export directory
        inits = {t.name: t for t in model.graph.initializer}
        for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
            arr = read_nbits(model.graph, node)
            name = node.input[1].removesuffix(".q")
            assert fp16_exact(arr.scales)
            if half:
                cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.output[0] == node.input[2])
                assert inits[cast.input[0]].data_type == onnx.TensorProto.FLOAT16
            else:
                assert inits[node.input[2]].data_type == onnx.TensorProto.FLOAT
            assert weights[name]["bytes_after"] == arr.b.nbytes + arr.scales.size * (2 if half else 4)
