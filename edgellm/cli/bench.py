"""`edgellm bench DIR`: prefill/decode speed, time to first token, runtime overhead and peak RSS of an export.

Workload (docs/benchmarks.md): fixed pseudo-random prompt ids (seed 1234), greedy, EOS ignored,
--new-tokens new tokens, 2 threads, one warm-up then --runs timed runs; median (min-max). Contexts: a short
prompt of 64 tokens and a long one of min(1024, max_seq - new_tokens) tokens. `--vs-torch CHECKPOINT`
runs edgellm's PyTorch model on the same prompts (own argmax loop, static cache, same threads, in a child
process) and prints the edgellm/PyTorch ratios. "overhead %" is the share of the decode time spent outside
onnxruntime's Run calls; "other load %" the most CPU other processes used during a kept run (runs are
repeated while it exceeds --max-other-load).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import integer, integers, number
from .run import PREFILL_WEIGHTS, add_pool_flag, add_prefill_weights_flag, shared_pool
from .speculation import add_exact_flag, add_speculative_flags, note_no_lone_stack, open_generator, speculate

JSON_SCHEMA = "edgellm-bench"
JSON_VERSION = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed and memory of an export",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="export directory")
    p.add_argument("--threads", type=integer, default=2, help="onnxruntime (and torch) threads (default 2)")
    p.add_argument("--runs", type=integer, default=3, help="timed runs per context after one warm-up (default 3)")
    p.add_argument("--new-tokens", type=integer, default=128, help="new tokens per run (default 128)")
    p.add_argument("--contexts", type=integers, help="comma-separated prompt lengths (default: 64 and a long one)")
    p.add_argument("--vs-torch", type=Path, metavar="CHECKPOINT",
                   help="also run this checkpoint's PyTorch model and print the ratios")
    add_prefill_weights_flag(p)
    p.add_argument("--max-other-load", type=number, default=3.0, metavar="PCT",
                   help="repeat a timed run (up to 5 times) while other processes use more than PCT%% of the "
                        "CPUs (default 3)")
    add_pool_flag(p, "bench")
    add_speculative_flags(p, default="off")
    add_exact_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (schema edgellm-bench v1)")
    p.set_defaults(func=run)


def _contexts(args: argparse.Namespace, max_seq: int) -> list[int]:
    from edgellm.runtime.errors import need

    room = max_seq - args.new_tokens
    contexts = args.contexts or sorted({min(64, room), min(1024, room)})
    need(all(1 <= c <= room for c in contexts),
         f"--contexts: each must be in 1..{room} (max_seq {max_seq} - --new-tokens {args.new_tokens})")
    return contexts


def run(args: argparse.Namespace) -> int:
    from edgellm.cli.bench_measure import bench_edgellm, bench_torch, format_table, ratios
    from edgellm.runtime.errors import need
    from edgellm.runtime.manifest import read_manifest
    from edgellm.runtime.session import SessionConfig
    from edgellm.runtime.stats import huge_pages_mb

    need(args.runs >= 1, f"--runs: expected an integer >= 1, got {args.runs}")
    need(args.new_tokens >= 2, f"--new-tokens: expected an integer >= 2, got {args.new_tokens}")
    need(args.vs_torch is None or args.vs_torch.exists(), f"--vs-torch: {args.vs_torch} not found")
    config = SessionConfig(threads=args.threads, prepack_prefill=PREFILL_WEIGHTS[args.prefill_weights],
                           shared_pool=shared_pool(args.thread_pool, "bench"))
    config.validate()
    # greedy, through the stack a greedy `edgellm run` (--speculative auto) opens, whatever --speculative says here
    gen, known = open_generator(args.directory, read_manifest(args.directory), config, args.exact_decode, 0.0, "auto")
    note_no_lone_stack(gen.manifest, args.exact_decode, args.directory)
    stack = gen.engine.stack_role if gen.engine.stacked else None  # which stack decodes: "stack" or "stack_lone"
    speculate(gen, args, config, known=known)  # the prompts are random ids: lookup shows its cost where nothing repeats
    max_seq = gen.manifest.max_seq
    contexts = _contexts(args, max_seq)
    rows = bench_edgellm(gen, contexts, args.new_tokens, args.runs, args.max_other_load)
    huge = huge_pages_mb()  # with the weights still loaded
    del gen
    if args.vs_torch is not None:
        rows += bench_torch(args.vs_torch, contexts, args.new_tokens, args.runs, args.threads, max_seq,
                            args.max_other_load)
    vs = ratios(rows)
    if args.json:
        print(json.dumps({"schema": JSON_SCHEMA, "version": JSON_VERSION, "export": str(args.directory),
                          "threads": args.threads, "shared_pool": config.shared_pool, "stack": stack,
                          "new_tokens": args.new_tokens, "runs": args.runs,
                          "max_seq": max_seq, "huge_pages_mb": round(huge, 1), "rows": [r.to_dict() for r in rows],
                          "vs_torch": {str(k): v for k, v in vs.items()}}))
        return 0
    pool = "shared" if config.shared_pool else "per-session"
    through = f", through {stack}.onnx" if stack else ""
    print(f"{args.directory}: {args.threads} threads ({pool} pool{through}), {args.new_tokens} new tokens, greedy, EOS "
          f"ignored, max_seq {max_seq}, {huge:.0f} MB in huge pages, median (min-max) of {args.runs} runs after "
          "a warm-up")
    for line in format_table(rows):
        print(line)
    for context, r in vs.items():
        same = "same tokens" if r["same_tokens"] else "TOKENS DIFFER"
        print(f"ctx {context}: edgellm / PyTorch  prefill {r['prefill']:.2f}x  decode {r['decode']:.2f}x  ({same})")
    return 0
