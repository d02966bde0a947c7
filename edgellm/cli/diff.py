"""`edgellm diff CHECKPOINT EXPORT [EXPORT ...] -o REPORT_DIR`: accuracy of exports against the PyTorch model.

Per layer (hidden states, K/V rows: cosine, max |diff|, relative RMS, SNR, the first layer that drifts), per
position (KL, top-1/top-5 agreement, Δp), perplexity, and greedy continuation agreement. Writes
report.html (self-contained) and report.json (versioned), prints a Markdown summary. With --fail-if the exit
code is a CI gate: 1 when a condition holds for any export, 0 otherwise (2 for bad input).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import integer, number


def register(sub: argparse._SubParsersAction) -> None:
    from edgellm.diff.gate import METRICS  # light: no torch

    p = sub.add_parser("diff", help="accuracy report: exports (fp32/int8/int4) vs the PyTorch model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="--fail-if metrics:\n" + "\n".join(f"  {k:<12} {v[1]}" for k, v in METRICS.items()))
    p.add_argument("checkpoint", type=Path, help="the checkpoint the exports were made from (any loader format)")
    p.add_argument("exports", type=Path, nargs="+", help="export directories (fp32, int8, int4 ...)")
    p.add_argument("-o", "--output", type=Path, required=True, help="report directory to write")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", type=Path, default=None, help="evaluation text file (UTF-8), tokenized with "
                                                              "the export's tokenizer")
    text.add_argument("--generated", type=integer, default=None, metavar="N",
                      help="evaluate on N tokens sampled from the PyTorch model (temperature 1, --seed) from BOS "
                           "(the default when --text is absent: --tokens - 1)")
    p.add_argument("--tokens", type=integer, default=256, help="evaluation tokens including BOS (default 256, "
                                                           "capped at the exports' max_seq)")
    p.add_argument("--prompts", type=integer, default=4, help="greedy continuation prompts (default 4)")
    p.add_argument("--prompt-len", type=integer, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--continuation", type=integer, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--seed", type=integer, default=0, help="seed of --generated (default 0)")
    p.add_argument("--fail-if", default=None, metavar="COND[,COND...]",
                   help='CI gate, e.g. "kl>0.05,top1<0.9,ppl_delta>0.05": exit 1 if any holds for any export')
    p.add_argument("--jump-factor", type=number, default=3.0,
                   help="drift rule: a layer drifts when its error exceeds this x the median before it (3)")
    p.add_argument("--jump-floor", type=number, default=1e-3,
                   help="drift rule: ... and this absolute relative-RMS floor (1e-3)")
    p.add_argument("--threads", type=integer, default=None,
                   help="torch/onnxruntime threads (default: 1 for models under 30M parameters, else all cores)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of export files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgellm.diff.gate import parse_gate
    from edgellm.diff.report_md import summary_markdown
    from edgellm.diff.run import DiffOptions, run_diff
    from edgellm.diff.writer import check_target, write_report
    from edgellm.loaders import load_checkpoint

    if args.fail_if:
        parse_gate(args.fail_if)  # bad syntax: exit 2 before loading anything
    check_target(args.output)
    options = DiffOptions(text=args.text, generated=args.generated, tokens=args.tokens, prompts=args.prompts,
                          prompt_len=args.prompt_len, continuation=args.continuation, seed=args.seed,
                          jump_factor=args.jump_factor, jump_floor=args.jump_floor, fail_if=args.fail_if,
                          verify_sha=not args.no_verify, threads=args.threads)
    loaded = load_checkpoint(args.checkpoint)
    report = run_diff(loaded, str(args.checkpoint), args.exports, options, progress=not args.quiet)
    write_report(report, args.output)
    print(summary_markdown(report))
    print(f"\nwrote {args.output / 'report.html'} and report.json ({report['seconds']:.1f} s)")
    gate = report["gate"]
    return 1 if gate is not None and not gate["passed"] else 0
