"""The fp32 decode ceiling of this machine: how fast weights stream from memory, and what that allows.

    python bench/membw.py [--threads 2] [--mb 438] [--runs 20]

fp32 decode reads every weight once per token (stories110M: 438 MB of matmul weights), so no runtime decodes
faster than bandwidth / weight bytes. Two measurements, in this process:
- a plain read: --threads numpy threads each summing its share of an --mb buffer (numpy releases the GIL);
- onnxruntime itself: one graph of stories110M's 48 layer `MatMul`s (M = 1, pre-packed weights, --threads
  intra-op threads), the kernels a decode step runs, without attention or the head.
Prints GB/s and the decode ceiling in tok/s for --mb of weights. Run it in the same minutes as the benchmark
it bounds (this VM's bandwidth drifts with its neighbours).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

D, F, LAYERS = 768, 2048, 12                         # stories110M
SHAPES = ((D, 3 * D), (D, D), (D, 2 * F), (F, D))    # qkv, o, gate_up, down: [K, N]


def plain_read(mb: float, threads: int, runs: int) -> float:
    """Median seconds for `threads` threads to read `mb` MB of float32 once."""
    buf = np.random.default_rng(0).random(int(mb * 1e6) // 4, dtype=np.float32)
    parts = np.array_split(buf, threads)
    times = []
    for _ in range(runs):
        workers = [threading.Thread(target=p.sum) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_stack(threads: int, runs: int) -> tuple[float, float]:
    """(median seconds, MB) of one Run of every layer MatMul of stories110M at M = 1."""
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for layer in range(LAYERS):
        for j, (k, n) in enumerate(SHAPES):
            w, out = f"w{layer}_{j}", f"y{layer}_{j}"
            inits.append(numpy_helper.from_array((rng.random((k, n), dtype=np.float32) - 0.5) * 0.01, w))
            nodes.append(helper.make_node("MatMul", ["xd" if k == D else "xf", w], [out]))
            outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, n]))
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("xd", TensorProto.FLOAT, [1, D]),
                                                 helper.make_tensor_value_info("xf", TensorProto.FLOAT, [1, F])],
                              outputs, inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feed = {"xd": rng.random((1, D), dtype=np.float32), "xf": rng.random((1, F), dtype=np.float32)}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(k * n for k, n in SHAPES) * LAYERS * 4 / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mb", type=float, default=438.0, help="fp32 weight MB read per token (default stories110M)")
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    read = plain_read(args.mb, args.threads, args.runs)
    mm, mm_mb = matmul_stack(args.threads, args.runs)
    for label, gbs in (("plain read", args.mb / read / 1e3), ("onnxruntime MatMul, M=1", mm_mb / mm / 1e3)):
        print(f"{label:<26} {gbs:5.1f} GB/s  -> fp32 decode ceiling for {args.mb:.0f} MB: "
              f"{gbs * 1e3 / args.mb:5.1f} tok/s")


if __name__ == "__main__":
    main()
