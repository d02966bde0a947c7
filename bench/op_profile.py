"""Where a decode step's time goes: each --step (the S = 1 graphs one decode step runs, in order: an edgellm
export's stack.onnx and head.onnx, or an onnxruntime-genai model.onnx) timed unprofiled, rounds alternating
between the steps, then each graph under onnxruntime's profiler, per operator type, at a fixed context length.

    python bench/op_profile.py --step EXP/stack.onnx EXP/head.onnx --step GENAI/model.onnx [--context 100]
                               [--rows S]

`--rows S` feeds S tokens per call (edgellm graphs: a speculative verification of S - 1 drafts is one stack and
head call at S rows): with --rows 1 beside it, where the extra rows' time goes.

All sessions share one global thread pool (--threads), as `edgellm run` runs them. Inputs are synthesized from
the graphs' declared inputs (one token, the cache lengths at --context, caches of seeded random values; genai's
shared KV buffers at 1024 rows), outputs bound in place like the runtimes bind them. The profiler adds time to every node, so its
sums are compared with each other, not with the unprofiled step times.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state

GENAI_ROWS = 1024  # onnxruntime-genai's past_present_share_buffer caches: [1, kv_heads, max_length, head_dim]


def bind(session: ort.InferenceSession, context: int, rows: int = 1) -> tuple[ort.IOBinding, list[np.ndarray]]:
    binding, keep = session.io_binding(), []
    outputs = {o.name for o in session.get_outputs()}

    def out(name: str, array: np.ndarray) -> None:
        keep.append(array)
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def inp(name: str, array: np.ndarray) -> None:
        keep.append(array)
        binding.bind_cpu_input(name, array)

    for i in session.get_inputs():
        n, shape = i.name, [d if isinstance(d, int) else 1 for d in i.shape]
        if len(shape) == 3 and not isinstance(i.shape[1], int):
            shape[1] = rows  # hidden [1, S, D]
        if n in ("tokens", "input_ids"):
            inp(n, np.full((1, rows), 42, np.int64))
        elif n == "seqlens_k":
            inp(n, np.array([context], np.int32))
        elif n == "total_len":
            inp(n, np.array(context + rows, np.int32))
        elif n == "attention_mask":
            inp(n, np.ones((1, context + 1), np.int64))
        elif n == "position_ids":
            inp(n, np.array([[context]], np.int64))
        elif "past" in n:  # a cache: read and written in place
            if not isinstance(i.shape[2], int):
                shape[2] = GENAI_ROWS
            if not isinstance(i.shape[3], int):
                shape[3] = 64
            # values, not zeros: onnxruntime's fp16 attention runs all-zero rows at half its speed (docs/benchmarks.md)
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32  # the export's kv_dtype
            cache = (np.random.default_rng(1).standard_normal(shape) * 0.5).astype(dtype)
            inp(n, cache)
            present = n.replace("past_key_values", "present").replace("past_", "present_")
            if present in outputs:
                out(present, cache)
        else:
            inp(n, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    for o in session.get_outputs():
        if not o.name.startswith("present"):
            shape = [d if isinstance(d, int) else 1 for d in o.shape]
            if len(shape) == 3 and not isinstance(o.shape[1], int):
                shape[1] = rows
            out(o.name, np.zeros(shape, np.float32))
    return binding, keep


def options(profile: bool) -> ort.SessionOptions:
    o = ort.SessionOptions()
    o.use_per_session_threads = False
    o.log_severity_level = 3
    if profile:
        o.enable_profiling = True
        o.profile_file_prefix = tempfile.mkdtemp() + "/profile"
    return o


def time_steps(steps: list[list[str]], context: int, rounds: int, calls: int, rows: int = 1) -> None:
    opened = []
    for step in steps:
        sessions = [ort.InferenceSession(p, options(False), providers=["CPUExecutionProvider"]) for p in step]
        opened.append([(s, *bind(s, context, rows)) for s in sessions])
    for r in range(rounds):
        for step, graphs in zip(steps, opened, strict=True):
            for _ in range(calls // 10 + 1):
                for session, binding, _keep in graphs:
                    session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(calls):
                for session, binding, _keep in graphs:
                    session.run_with_iobinding(binding)
            ms = (time.perf_counter() - start) / calls * 1000
            print(f"round {r + 1}: {' + '.join(step)}: {ms:.3f} ms per step (unprofiled)")


def profile(path: str, context: int, steps: int, rows: int = 1) -> None:
    session = ort.InferenceSession(path, options(True), providers=["CPUExecutionProvider"])
    binding, _keep = bind(session, context, rows)
    for _ in range(steps):
        session.run_with_iobinding(binding)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    kernel, count, runs, wall = collections.Counter(), collections.Counter(), 0, 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            kernel[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            runs, wall = runs + 1, wall + e["dur"]
    print(f"{path}: model_run {wall / runs / 1000:.3f} ms, kernels {sum(kernel.values()) / runs / 1000:.3f} ms "
          f"(mean of {runs} steps at context {context})")
    for op, us in kernel.most_common():
        print(f"  {op:34s} {us / runs / 1000:6.3f} ms  ({count[op] // runs} nodes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", nargs="+", action="append", required=True, metavar="GRAPH")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1, help="rows per call: S = k + 1 of a verification (edgellm graphs)")
    args = p.parse_args()
    _pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    time_steps(args.step, args.context, args.rounds, args.steps, args.rows)
    for step in args.step:
        for path in step:
            profile(path, args.context, args.steps, args.rows)


if __name__ == "__main__":
    main()
