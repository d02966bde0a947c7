"""The speculation and exact-decode flags `edgellm run` and `edgellm bench` share, and how they open an export:
which stack decodes (the exact one with its spare attention row, or the lone-row one) and whether greedy
`--speculative auto` drafts, from what this machine's kernels do with the export's rows (runtime/rows_memo.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from . import integer


def add_speculative_flags(p: argparse.ArgumentParser, default: str = "auto") -> None:
    from edgellm.runtime.draft_length import DRAFT_TOKENS

    p.add_argument("--speculative", choices=("auto", "off", "lookup", "draft"), default=default,
                   help="speculative decoding, faster where the answer repeats its context: lookup drafts from the "
                        "context (prompt lookup), draft runs --draft DIR as the drafter; adaptive, so text that "
                        "repeats nothing decodes at plain speed. auto: lookup where a verification computes every "
                        "row bit for bit as a decode step does (fused layers with the stack, the default export "
                        "layout, fp32 and quantized alike: greedy gives plain decoding's tokens) and, when "
                        "sampling, through the lone-row stack too (rejection sampling), else off "
                        "(default " + default + ")")
    p.add_argument("--draft", type=Path, metavar="DIR", help="with --speculative draft: a smaller export with the "
                                                               "same tokenizer")
    p.add_argument("--draft-tokens", type=integer, default=DRAFT_TOKENS, metavar="K",
                   help=f"at most this many drafts per verification; fewer where draft rows cost more than they win "
                        f"(default {DRAFT_TOKENS})")


def add_exact_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exact-decode", choices=("auto", "on", "off"), default="auto",
                   help="on: each decode step computes its row exactly as a speculative verification does (the "
                        "export's spare attention row), so greedy speculation keeps plain decoding's tokens; off: "
                        "the stack without that row (format 13 exports), up to ~25%% faster decode, not bit for bit "
                        "a verification row (auto speculation then stays off for greedy decoding); auto (default): "
                        "on for greedy decoding that may speculate, unless this machine's kernels compute a "
                        "verification row unlike a decode step for this export anyway (measured once, remembered "
                        "in ~/.cache/edgellm/rows.json); off when sampling (rejection sampling keeps the "
                        "distribution either way) or with --speculative off")


def exact_decode(choice: str, temperature: float, speculative: str = "auto", rows_exact: bool | None = None) -> bool:
    """--exact-decode -> SessionConfig.exact. auto: on for greedy decoding (temperature 0) that may speculate,
    unless `rows_exact` is False (this machine computes the export's verification rows unlike its decode steps
    even with the spare row: it would cost decode steps and buy nothing)."""
    if choice != "auto":
        return choice == "on"
    return temperature == 0 and speculative != "off" and rows_exact is not False


def open_generator(directory: Path, manifest, config, choice: str, temperature: float, speculative: str):
    """(Generator, Verdict or None): the Generator run / bench decode with (`choice`: --exact-decode; `speculative`:
    the --speculative mode its stack is picked for), and for a greedy run that may speculate, whether its rows are
    exact here. Not remembered yet (rows_memo): measured on the opened engine (`rows_exact_here`) and remembered;
    when they are not exact and auto opened the spare-row stack, it is opened again through the lone-row stack, so
    every greedy run of this export on this machine decodes through one stack (the first run included)."""
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.rows_memo import Verdict, memo_key, recall, remember
    from edgellm.runtime.speculative import rows_exact_here
    from edgellm.runtime.variant import stack_role

    key = memo_key(directory, config.threads) if temperature == 0 and speculative != "off" else None
    known = recall(key) if key is not None else None
    exact = exact_decode(choice, temperature, speculative, known.exact if known is not None else None)
    gen = Generator(directory, manifest, dataclasses.replace(config, exact=exact))
    if key is None or known is not None or not gen.engine.exact_rows:
        return gen, known
    exact_here, diff = rows_exact_here(gen.engine)
    if diff == float("inf"):  # a cache too short to probe (a few rows): nothing to remember, nothing to draft on
        return gen, None
    known = Verdict(exact_here, diff)
    remember(key, known, directory)
    lone = dataclasses.replace(config, exact=False)
    if not known.exact and choice == "auto" and stack_role(manifest, lone) != gen.engine.stack_role:
        gen.reopen(lone)
    return gen, known


def note_no_lone_stack(manifest, choice: str, directory: Path) -> None:
    """`--exact-decode off` asked for a lone-row stack the export does not have (format 12 or older): say so."""
    if choice == "off" and manifest.has_stack and not manifest.has_lone_stack:
        print(f"[--exact-decode off: {directory} (format {manifest.format_version}) has no lone-row stack; "
              "decoding with the exact one. Quantize or export it again with this edgellm for one]", file=sys.stderr)


def auto_mode(engine, known, sampled: bool = False) -> str:
    """What `--speculative auto` runs on an opened engine: for a `sampled` run lookup wherever the stack verifies
    rows in one call; for greedy, lookup only where a verification row is bit for bit a decode step — built so
    (`Engine.exact_rows`) and measured so here (`known`, open_generator's Verdict) — else off."""
    if sampled:
        return "lookup" if engine.any_rows else "off"
    return "lookup" if engine.exact_rows and known is not None and known.exact else "off"


def speculate(gen, args: argparse.Namespace, config, sampled: bool = False, known=None) -> None:
    """Apply --speculative / --draft / --draft-tokens to an opened Generator. auto: for a `sampled` run, lookup
    wherever the stack verifies rows in one call (the lone-row stack too: rejection sampling keeps the
    distribution whatever the rows' last bits); for greedy, lookup where a verification row is bit for bit a
    decode step — built so (`Engine.exact_rows`) and measured so on this machine (`known`, open_generator's) —
    so greedy keeps plain decoding's tokens; else off (with a note when only this CPU's kernels are why)."""
    mode = args.speculative
    if mode == "auto":
        engine = gen.engine
        mode = auto_mode(engine, known, sampled)
        if not sampled and known is not None and not known.exact:
            from edgellm.runtime.rows_memo import memo_path

            where = f"remembered in {memo_path()}" if known.remembered else "measured now, remembered"
            lone = "; decoding through the lone-row stack" if engine.stack_role == "stack_lone" else ""
            print(f"[--speculative auto: off: this CPU computes a verification row {known.diff:.2g} away from a "
                  f"decode step ({where}), so greedy speculation could change the text at a near-tie{lone}; "
                  "--speculative lookup uses it anyway]", file=sys.stderr)
    gen.speculate(mode, args.draft, args.draft_tokens, config)
