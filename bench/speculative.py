"""Speculative decoding (prompt lookup) vs plain decoding on a chat model: same process, same sessions,
alternating rounds; every case must give the same greedy tokens both ways (asserted).

    python bench/speculative.py EXPORT [EXPORT ...] [--rounds 3] [--new-tokens 192] [--threads 2]

Tasks (chat template, greedy, EOS ends a run): grounded ones hold TEXT (~330 tokens) or CODE in the prompt and
ask to repeat, correct, extract from or edit it; free-form ones hold nothing to copy. Prints decode tok/s per
task and mode (median over rounds), the speculative / plain ratio per task and the median ratio per group, and
the machine's load average (the VM is shared). `--json FILE` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

TEXT = (
    "The lighthouse on Marrow Point was built in 1871 from granite quarried eleven miles inland. Its lamp, "
    "first fuelled by whale oil and later by kerosene, stood 34 metres above the high-water mark and could be "
    "seen from 19 nautical miles on a clear night. The first keeper, Elias Brandt, kept a logbook for 27 years; "
    "in it he recorded 412 storms, 63 shipwrecks and the names of 140 sailors his crew pulled from the water. "
    "In 1923 the lamp was electrified, and in 1961 the station was automated, which ended the keepers' service. "
    "The keeper's cottage now houses a small museum. Its most visited exhibit is the original Fresnel lens, "
    "made in Paris by the firm of Henry-Lepaute, which weighs nearly three tonnes and is assembled from 96 "
    "glass prisms. Visitors can climb the 153 steps of the tower between April and October, and on the first "
    "Sunday of each month volunteers light a replica of the old oil lamp at dusk. The museum also keeps a "
    "collection of letters written by the keepers' families, describing winters when the supply boat could "
    "not land for six weeks and the children were taught at home by lamplight."
)
TYPOS = (TEXT.replace("granite", "granit").replace("recorded", "recordded").replace("visited", "visitted")
         .replace("assembled", "asembled").replace("families", "familys").replace("describing", "discribing"))
CODE = '''def summarize(records):
    x = 0
    count = 0
    for record in records:
        if record.get("valid"):
            x += record["amount"]
            count += 1
    if count == 0:
        return {"x": 0, "count": 0, "mean": None}
    return {"x": x, "count": count, "mean": x / count}


def report(records):
    result = summarize(records)
    print("total:", result["x"])
    print("count:", result["count"])
    print("mean:", result["mean"])
'''
TASKS = {
    "repeat": ("grounded", f"Repeat the following text exactly, word for word:\n\n{TEXT}"),
    "correct": ("grounded", f"Fix the spelling mistakes in this text and write out the whole corrected text:\n\n{TYPOS}"),
    "extract": ("grounded", f"Copy every sentence of the following text that contains a number, one per line, "
                            f"exactly as written:\n\n{TEXT}"),
    "code-edit": ("grounded", f"Rename the variable `x` to `total` in this Python code and output the full code:\n\n"
                              f"```python\n{CODE}```"),
    "story": ("free", "Write a short story about a robot who learns to paint."),
    "explain": ("free", "Explain why the sky is blue to a ten-year-old."),
    "tips": ("free", "Give me five tips for learning a new language, with a sentence on each."),
}


def run_case(gen, ids: list[int], mode: str, new_tokens: int,
             draft_tokens: int | None = None) -> tuple[float, list[int], dict | None]:
    from edgellm.runtime.sampling import SamplingParams, StopParams
    from edgellm.runtime.speculative import DRAFT_TOKENS

    gen.speculate(mode, draft_tokens=draft_tokens or DRAFT_TOKENS)
    r = gen.complete(ids, SamplingParams(temperature=0), StopParams(new_tokens), text=False)
    return r.timings.decode_tok_s, r.token_ids, r.speculative


def bench(directory: Path, rounds: int, new_tokens: int, threads: int) -> dict:
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.session import SessionConfig

    gen = Generator.open(directory, config=SessionConfig(threads=threads, shared_pool=True))
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    speeds: dict[str, dict[str, list[float]]] = {t: {"off": [], "lookup": []} for t in TASKS}
    stats: dict[str, dict | None] = {}
    differ: dict[str, int] = {}  # task -> first new token where speculative and plain greedy differ
    for rnd in range(rounds + 1):  # round 0 warms up (not kept)
        for name, ids in prompts.items():
            order = ("off", "lookup") if rnd % 2 else ("lookup", "off")
            got = {}
            for mode in order:
                tok_s, tokens, spec = run_case(gen, ids, mode, new_tokens)
                got[mode] = tokens
                if rnd:
                    speeds[name][mode].append(tok_s)
                if spec is not None:
                    stats[name] = spec | {"new_tokens": len(tokens), "prompt_tokens": len(ids)}
            if got["off"] != got["lookup"]:  # recorded, and the run fails at the end (exit 1)
                first = next((i for i, (a, b) in enumerate(zip(got["off"], got["lookup"], strict=False)) if a != b),
                             min(len(got["off"]), len(got["lookup"])))
                differ.setdefault(name, first)
        print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return {"speeds": speeds, "stats": stats, "load": os.getloadavg(), "differ": differ}


def table(directory: Path, res: dict) -> list[str]:
    lines = [f"{directory}  (decode tok/s, median of rounds; load avg {res['load'][0]:.1f}/{res['load'][2]:.1f})",
             f"  {'task':<10} {'group':<9} {'plain':>7} {'lookup':>7} {'ratio':>6} {'min-max ratio':>14}  accepted/drafted"]
    ratios: dict[str, list[float]] = {"grounded": [], "free": []}
    for name, (group, _) in TASKS.items():
        s = res["speeds"][name]
        per_round = [b / a for a, b in zip(s["off"], s["lookup"], strict=True)]
        r = statistics.median(per_round)
        ratios[group].append(r)
        st = res["stats"].get(name) or {}
        lines.append(f"  {name:<10} {group:<9} {statistics.median(s['off']):>7.1f} {statistics.median(s['lookup']):>7.1f} "
                     f"{r:>5.2f}x {min(per_round):>6.2f}-{max(per_round):.2f}x  {st.get('accepted')}/{st.get('drafted')}"
                     f" of {st.get('new_tokens')} new")
    for name, at in res["differ"].items():
        lines.append(f"  {name}: TOKENS DIFFER from plain greedy from new token {at}")
    if not res["differ"]:
        lines.append("  every task: the same greedy tokens as plain decoding, every round")
    for group, rs in ratios.items():
        lines.append(f"  {group}: median ratio {statistics.median(rs):.2f}x (tasks {', '.join(f'{r:.2f}' for r in rs)})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    for directory in args.exports:
        results[str(directory)] = bench(directory, args.rounds, args.new_tokens, args.threads)
        for line in table(directory, results[str(directory)]):
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if any(r["differ"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
