"""What exact speculation costs plain decoding: the fused layers' spare attention row (manifest format 10+).

    python bench/spare_row.py EXPORT [--contexts 100,400] [--rounds 8] [--steps 300] [--threads 2]

A decode step runs GroupQueryAttention on its one real row plus a zero row (a Pad before it, a Slice after it,
the lengths + 1), because onnxruntime's kernel computes a lone row in another summation order than the same row
among two or more, and a speculative verification runs k + 1 rows (runtime/speculative.py, export/fused.py).
This writes a copy of EXPORT (a temporary directory) whose stack graph has those nodes bypassed, i.e. the
decode step as it would be without exactness, then
1. checks the reason: through the runtime, one token decoded alone vs the same token as the first row of a
   two-row verification, max |logit difference| for EXPORT (0: exact) and for the copy (> 0);
2. times the decode step (stack + head graphs, one process, one thread pool, the two exports alternating each
   round, caches filled to each context length; bench/op_profile.py's bindings) and prints the median ms per
   step of each and their ratio.
The copy is a measurement artifact: its verification rows are not its decode steps, so it must not speculate
(a format-13 export carries the same graph as stack_lone.onnx, which only sampled runs open).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import _pybind_state
from op_profile import bind, options

from edgellm.layout.lone import lone_rows
from edgellm.runtime.engine import Engine
from edgellm.runtime.fileio import describe_files
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.session import SessionConfig


def without_spare_row(src: Path, out: Path) -> int:
    """Copy `src` to `out` with its stack.onnx replaced by the stack without the spare row (lone.py's rule, the
    one format 13 writes as stack_lone.onnx: older exports have none); return the nodes removed."""
    shutil.copytree(src, out)
    lone, removed = lone_rows(onnx.load(str(out / "stack.onnx"), load_external_data=False))
    onnx.save(lone, str(out / "stack.onnx"))
    manifest = read_manifest(src, verify=False)
    replace(manifest, files={**manifest.files, **describe_files(out, ["stack.onnx"])}).write(out)
    return removed


def row_difference(directory: Path, tokens: list[int]) -> float:
    """max |logits of tokens[-1] decoded alone - its row in a two-row call|, after the same prefix."""
    rows = []
    for n in (1, 2):
        engine = Engine.open(directory, read_manifest(directory, verify=False), SessionConfig(exact=True))
        engine.forward(tokens[:-1])
        rows.append((engine.forward(tokens[-1:]) if n == 1 else engine.few_rows([tokens[-1], tokens[0]])[0]).copy())
    return float(np.abs(rows[0] - rows[1]).max())


def time_steps(exports: list[Path], context: int, rounds: int, steps: int) -> list[list[float]]:
    """ms per decode step of each export's stack + head, alternating each round."""
    opened = []
    for d in exports:
        sessions = [ort.InferenceSession(str(d / f), options(False), providers=["CPUExecutionProvider"])
                    for f in ("stack.onnx", "head.onnx")]
        opened.append([(s, *bind(s, context)) for s in sessions])
    times: list[list[float]] = [[] for _ in exports]
    for r in range(rounds):
        order = range(len(exports)) if r % 2 == 0 else reversed(range(len(exports)))
        for i in order:
            for _ in range(steps // 10 + 1):
                for session, binding, _keep in opened[i]:
                    session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(steps):
                for session, binding, _keep in opened[i]:
                    session.run_with_iobinding(binding)
            times[i].append((time.perf_counter() - start) / steps * 1000)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("--contexts", default="100,400")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    m = read_manifest(args.export, verify=False)
    contexts = [int(c) for c in args.contexts.split(",")]
    if not m.has_stack or m.max_seq <= max(contexts):
        raise SystemExit(f"{args.export}: needs a stack graph and max_seq > {max(contexts)} (has {m.max_seq})")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "no-spare-row"
        removed = without_spare_row(args.export, copy)
        tokens = [int(t) for t in np.random.default_rng(0).integers(3, m.vocab_size, 40)]
        print(f"{args.export}: {m.n_layers} layers; the copy without the spare row: {removed} nodes fewer")
        print(f"lone row vs the same row of a 2-row call, max |logit diff|: with the spare row "
              f"{row_difference(args.export, tokens):.3g}, without {row_difference(copy, tokens):.3g}")
        _pybind_state.set_global_thread_pool_sizes(args.threads, 1)
        for context in contexts:
            with_row, without = (statistics.median(t) for t in time_steps([args.export, copy], context,
                                                                         args.rounds, args.steps))
            print(f"context {context:>5}: decode step {with_row:.3f} ms with the spare row, {without:.3f} ms "
                  f"without ({with_row / without:.3f}x)")


if __name__ == "__main__":
    main()
