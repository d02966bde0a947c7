"""`edgellm` command line: one module per verb, each exposing `register(subparsers)`.

Verb modules import their heavy dependencies (torch, onnx) inside their `run` function, so `edgellm run`
works on a board that has only numpy, onnxruntime and tokenizers installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from edgellm import __version__
from edgellm.runtime.errors import EdgeError

# verb -> module under edgellm.cli; the order is the order of `edgellm --help`.
VERBS = {
    "info": "info",
    "train": "train",
    "tokenizer": "tokenizer",
    "export": "export",
    "quantize": "quantize",
    "run": "run",
    "bench": "bench",
    "diff": "diff",
    "demo": "demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgellm",
        description="Put a decoder-only LLM on an ARM board: load/train -> export -> quantize -> run -> diff.",
    )
    parser.add_argument("--version", action="version", version=f"edgellm {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for module in VERBS.values():
        try:
            mod = importlib.import_module(f"edgellm.cli.{module}")
        except ModuleNotFoundError as exc:  # a verb whose module is not written yet
            if exc.name == f"edgellm.cli.{module}":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except EdgeError as exc:
        print(f"edgellm {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edgellm {args.verb}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
