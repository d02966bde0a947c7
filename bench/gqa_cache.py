"""One GroupQueryAttention step on an fp32 cache vs an fp16 cache (through the Casts edgellm's fp16 layers use),
per head shape and context: what quant/kv_cache.py's `--kv-dtype auto` rule weighs.

    python bench/gqa_cache.py [--threads 2] [--contexts 64,180,500,1500]

S = 1 is a lone-row decode step, S = 2 the spare-row stack's step (docs/design.md). Caches of seeded random
values, bound in place as the runtime binds them, the node's inputs and outputs only: one layer's cache stays in
the CPU's caches, so this is the kernel's compute, not the DRAM reads a real decode step also pays (which the
fp16 cache halves). Each timing is the median of 5 alternating rounds of 300 calls.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

MAX_SEQ = 2048
SHAPES = ((14, 2, 64), (9, 3, 64), (12, 12, 64), (32, 8, 64))  # (q heads, kv heads, head dim): 0.5B, SmolLM2, s110m, 8B


def build(heads: int, kv_heads: int, hd: int, half: bool, threads: int) -> ort.InferenceSession:
    width, cache = (heads + 2 * kv_heads) * hd, TensorProto.FLOAT16 if half else TensorProto.FLOAT
    nodes, qkv = [], "qkv"
    if half:
        nodes.append(helper.make_node("Cast", ["qkv"], ["qkv16"], to=TensorProto.FLOAT16))
        qkv = "qkv16"
    nodes.append(helper.make_node("GroupQueryAttention", [qkv, "", "", "past_key", "past_value", "seqlens_k",
                                                          "total_len", "cos", "sin"],
                                  ["out16" if half else "out", "present_key", "present_value"], domain="com.microsoft",
                                  num_heads=heads, kv_num_heads=kv_heads, do_rotary=1))
    if half:
        nodes.append(helper.make_node("Cast", ["out16"], ["out"], to=TensorProto.FLOAT))
    rng = np.random.default_rng(0)
    table = rng.random((MAX_SEQ + 1, hd // 2)).astype(np.float16 if half else np.float32)
    inits = [helper.make_tensor(n, cache, table.shape, f(table).tobytes(), raw=True) for n, f in (("cos", np.cos),
                                                                                                  ("sin", np.sin))]
    rows = [1, kv_heads, MAX_SEQ + 1, hd]
    graph = helper.make_graph(
        nodes, "gqa",
        [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "S", width]),
         helper.make_tensor_value_info("past_key", cache, rows), helper.make_tensor_value_info("past_value", cache, rows),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total_len", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("present_key", cache, rows),
         helper.make_tensor_value_info("present_value", cache, rows)], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def step_us(session: ort.InferenceSession, context: int, rows: int, calls: int = 300) -> float:
    """µs per call with `rows` new rows after `context` cached ones, the caches bound as their own outputs."""
    rng = np.random.default_rng(1)
    shape = session.get_inputs()[1].shape
    dtype = np.float16 if session.get_inputs()[1].type == "tensor(float16)" else np.float32
    width = session.get_inputs()[0].shape[2]
    binding, keep = session.io_binding(), []
    binding.bind_cpu_input("qkv", rng.standard_normal((1, rows, width)).astype(np.float32))
    for name in ("key", "value"):
        cache = rng.standard_normal(shape).astype(dtype)
        keep.append(cache)
        binding.bind_input(f"past_{name}", "cpu", 0, dtype, shape, cache.ctypes.data)
        binding.bind_output(f"present_{name}", "cpu", 0, dtype, shape, cache.ctypes.data)
    binding.bind_cpu_input("seqlens_k", np.array([context + rows - 1], np.int32))
    binding.bind_cpu_input("total_len", np.array(context + rows, np.int32))
    binding.bind_output("out")
    for _ in range(20):
        session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(calls):
        session.run_with_iobinding(binding)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="64,180,500,1500")
    args = p.parse_args()
    print("| heads / kv heads / dim | context | S = 1 fp32 / fp16 µs | ratio | S = 2 fp32 / fp16 µs | ratio |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        sessions = {half: build(*shape, half, args.threads) for half in (False, True)}
        for context in (int(c) for c in args.contexts.split(",")):
            cells = []
            for rows in (1, 2):
                times = {half: [] for half in sessions}
                for _ in range(5):
                    for half, session in sessions.items():
                        times[half].append(step_us(session, context, rows))
                f32, f16 = (float(np.median(times[h])) for h in (False, True))
                cells.append(f"{f32:.0f} / {f16:.0f} | {f16 / f32:.2f}x")
            print(f"| {'/'.join(map(str, shape))} | {context} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
