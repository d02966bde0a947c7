"""`edgellm` command line: one module per verb, each exposing `register(subparsers)`.

Verb modules import their heavy dependencies (torch, onnx) inside their `run` function, so `edgellm run`
works on a board that has only numpy, onnxruntime, tokenizers (and jinja2, for `--chat`) installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

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


# Runtime (Python API) parameters whose errors reach the CLI; the runtime never names flags.
RUNTIME_PARAMS = ("prompt", "prompt_ids", "truncate", "chat", "stop", "threads", "temperature", "top_k", "top_p",
                  "min_p", "repetition_penalty", "max_new_tokens", "seed", "vocab_size", "speculative", "draft_tokens",
                  "draft")


def as_flags(message: str) -> str:
    """An EdgeError's message with the runtime parameters it names (`name:` first, or `name` in backticks) as
    the CLI flags that set them (--name-with-dashes)."""
    for name in RUNTIME_PARAMS:
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"`{name}`", flag)
        if message.startswith(f"{name}:"):
            message = flag + message[len(name):]
    return message


def _number_type(convert, what: str):
    def parse(text: str):
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    return parse


# argparse `type=` for every numeric flag: a bad value is the parser's one-line error (exit 2)
integer, number = _number_type(int, "an integer"), _number_type(float, "a number")
integers = _number_type(lambda text: [int(x) for x in text.split(",")], "comma-separated integers")


class _Parser(argparse.ArgumentParser):
    """argparse's errors as ONE line, exit 2, like every other bad input (no multi-line usage block), the flag
    first as in every EdgeError ("--top-k: expected an integer, got 'x'"); subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a bad flag (its one line printed, 2), --help or --version (0): a code like any error
        return int(exc.code or 0)
    try:
        code = args.func(args)
    except BrokenPipeError:  # the reader went away (`edgellm info DIR | head`): stop quietly, as cat does
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except EdgeError as exc:
        print(f"edgellm {args.verb}: error: {as_flags(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # the environment (disk full, permissions, a path through a file), not a bug: one line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"edgellm {args.verb}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edgellm {args.verb}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


def entry() -> int:
    """The `edgellm` command (console script, `python -m edgellm`): `main` on sys.argv, re-executed first with
    huge pages asked for where that speeds `run` and `bench` up (hugepages.py). `main(argv)` itself never
    re-executes: scripts and tests call it in their own process."""
    from edgellm.cli.hugepages import relaunch_with_huge_pages

    relaunch_with_huge_pages(sys.argv[1:])
    return main()


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of the dead pipe raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass


if __name__ == "__main__":
    sys.exit(entry())
