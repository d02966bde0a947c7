"""What a verification row costs, per kernel: onnxruntime's MatMulNBits (int4, int8; block 32, accuracy level 4 as
`edgellm quantize` writes it) and the fp32 MatMul, each at M = 1..16 rows against M = 1, on SmolLM2-135M's
shapes (issue 26: speculative decoding verifies k drafts in one S = k + 1 run, so its gain is bounded by how
the weights' kernels scale with rows).

    python bench/matmul_rows.py [--threads 2] [--calls 30]

One session per kernel and shape: the model's 30 layers as 30 copies of the weight, all fed the same rows
in one run (so the weights come from memory, as in a decode step, not from a cache holding one matrix); the
head once. Random weights (the timing does not depend on their values), median of three passes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROWS = (1, 2, 3, 5, 9, 17)
SHAPES = {"qkv 576x960": (576, 960, 30), "gate_up 576x3072": (576, 3072, 30), "down 1536x576": (1536, 576, 30),
          "head 576x49152": (576, 49152, 1)}  # K x N, copies
BLOCK = 32


def session(kind: str, k: int, n: int, copies: int, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    ys = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]) for i in range(copies)]
    nodes, inits, domains = [], [], []
    for i in range(copies):
        if kind == "fp32":
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), np.float32) * 0.02, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
            continue
        bits = 4 if kind == "int4" else 8
        blocks = (k + BLOCK - 1) // BLOCK
        inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, BLOCK * bits // 8), np.uint8), f"b{i}"),
                  numpy_helper.from_array(rng.random(n * blocks, np.float32) * 0.01, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"b{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4))
        domains = [helper.make_opsetid("com.microsoft", 1)]
    graph = helper.make_graph(nodes, kind, [x], ys, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), *domains], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def seconds(sess: ort.InferenceSession, rows: int, k: int, calls: int) -> float:
    feed = {"x": np.random.default_rng(1).standard_normal((rows, k), np.float32)}
    for _ in range(5):
        sess.run(None, feed)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            sess.run(None, feed)
        passes.append((time.perf_counter() - start) / calls)
    return statistics.median(passes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; time at M rows / time at M = 1")
    print("| kernel | shape | M = 1 (us) | " + " | ".join(f"M = {m}" for m in ROWS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(ROWS) - 1))
    for kind in ("int4", "int8", "fp32"):
        for name, (k, n, copies) in SHAPES.items():
            sess = session(kind, k, n, copies, args.threads)
            one = seconds(sess, 1, k, args.calls)
            ratios = [seconds(sess, m, k, args.calls) / one for m in ROWS[1:]]
            print(f"| {kind} | {name}{f' x {copies}' if copies > 1 else ''} | {one * 1e6:.0f} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
