"""The fp32 decode ceiling of this machine: how fast weights stream from memory, and what that allows.

    python bench/membw.py [--shape stories110m] [--threads 2] [--runs 20]

fp32 decode reads every matmul weight once per token (stories110M: 438 MB; the shapes are edgellm's SHAPES),
so no runtime decodes faster than bandwidth / those bytes. Two measurements, in this process:
- a plain read: --threads numpy threads each summing its share of a buffer of that size (numpy releases the
  GIL);
- onnxruntime itself: one graph of the shape's layer `MatMul`s (qkv, o, gate_up, down; M = 1, pre-packed
  weights, --threads intra-op threads), the kernels a decode step runs, without attention or the head.
Prints GB/s and the decode ceiling in tok/s. Run it in the same minutes as the benchmark it bounds (this VM's
bandwidth drifts with its neighbours).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgellm.model.config import SHAPES, ModelConfig


def layer_matmuls(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[K, N] of one layer's matmul weights, fused as edgellm fuses them: qkv, o, gate_up, down."""
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    return [(cfg.dim, q + 2 * kv), (q, cfg.dim), (cfg.dim, 2 * cfg.hidden_dim), (cfg.hidden_dim, cfg.dim)]


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


def matmul_stack(cfg: ModelConfig, threads: int, runs: int) -> tuple[float, float]:
    """(median seconds, MB) of one Run of every layer MatMul of `cfg` at M = 1."""
    rng = np.random.default_rng(0)
    nodes, inits, inputs, outputs = [], [], {}, []
    for layer in range(cfg.n_layers):
        for j, (k, n) in enumerate(layer_matmuls(cfg)):
            w, out = f"w{layer}_{j}", f"y{layer}_{j}"
            inputs.setdefault(k, helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]))
            inits.append(numpy_helper.from_array((rng.random((k, n), dtype=np.float32) - 0.5) * 0.01, w))
            nodes.append(helper.make_node("MatMul", [f"x{k}", w], [out]))
            outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, n]))
    graph = helper.make_graph(nodes, "matmuls", list(inputs.values()), outputs, inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feed = {f"x{k}": rng.random((1, k), dtype=np.float32) for k in inputs}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(init.dims[0] * init.dims[1] for init in inits) * 4 / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="stories110m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    cfg = ModelConfig.from_dict(SHAPES[args.shape])
    per_token_mb = (cfg.n_layers * sum(k * n for k, n in layer_matmuls(cfg)) + cfg.dim * cfg.vocab_size) * 4 / 1e6
    read = plain_read(per_token_mb, args.threads, args.runs)
    mm, mm_mb = matmul_stack(cfg, args.threads, args.runs)
    for label, gbs in (("plain read", per_token_mb / read / 1e3), ("onnxruntime MatMul, M=1", mm_mb / mm / 1e3)):
        print(f"{label:<26} {gbs:5.1f} GB/s  -> fp32 decode ceiling of {args.shape} ({per_token_mb:.0f} MB per "
              f"token): {gbs * 1e3 / per_token_mb:5.1f} tok/s")


if __name__ == "__main__":
    main()
