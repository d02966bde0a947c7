"""Speculative decoding (prompt lookup) vs plain decoding on a chat model: same process, same sessions,
alternating rounds; every case must give the same greedy tokens both ways (asserted).

    python bench/speculative.py EXPORT [EXPORT ...] [--rounds 3] [--new-tokens 192] [--threads 2]
                                [--draft-tokens K [K ...]] [--draft DIR]

Tasks (chat template, greedy, EOS ends a run): grounded ones hold TEXT (~330 tokens) or CODE in the prompt and
ask to repeat, correct, extract from or edit it; free-form ones hold nothing to copy. Prints decode tok/s per
task and mode (median over rounds), the speculative / plain ratio per task and the median ratio per group, and
the machine's load average (the VM is shared), and per task the oracle bound (bench/speculative_bound.py: the
ratio a policy knowing the tokens in advance would reach with the same drafter at verification costs measured
here, at the task's context) and those costs. `--draft-tokens 16 32` runs lookup once per k_max in each round
(the order rotating; a column each, each with cost estimates of its own), to compare settings on the same
tokens. `--draft DIR` adds a column: `--speculative draft` with that export (same tokenizer, e.g. the target's own
int4 `--profile small` export) as the drafter, k_max the runtime's. `--json FILE` writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from speculative_bound import bound, measure_curve

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


def run_case(gen, ids: list[int], mode: str, new_tokens: int, draft_tokens: int | None = None,
             costs=None, draft: Path | None = None) -> tuple[float, list[int], dict | None]:
    """One greedy generation; `costs`: the draft_length.Costs this setting keeps across its runs (a process has one
    k_max, so settings compared in one process must not share cost estimates), None: the Generator's."""
    from edgellm.runtime.draft_length import DRAFT_TOKENS
    from edgellm.runtime.sampling import SamplingParams, StopParams

    gen.speculate(mode, draft=draft, draft_tokens=draft_tokens or DRAFT_TOKENS)  # a draft export opens once
    if costs is not None:
        gen.costs = costs
    r = gen.complete(ids, SamplingParams(temperature=0), StopParams(new_tokens), text=False)
    return r.timings.decode_tok_s, r.token_ids, r.speculative


def bench(directory: Path, rounds: int, new_tokens: int, threads: int, ks: list[int],
          draft: Path | None = None) -> dict:
    from edgellm.runtime.draft_length import Costs
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.session import SessionConfig

    gen = Generator.open(directory, config=SessionConfig(threads=threads, shared_pool=True, exact=True))
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    settings = ["off", *(f"k{k}" for k in ks)] + (["draft"] * (draft is not None))  # plain, lookup per k_max, draft
    costs = {s: Costs() for s in settings[1:]}  # each k_max its own estimates, as in a process of its own
    speeds: dict[str, dict[str, list[float]]] = {t: {s: [] for s in settings} for t in TASKS}
    stats: dict[str, dict[str, dict]] = {t: {} for t in TASKS}
    differ: dict[str, int] = {}  # task -> first new token where a speculative run and plain greedy differ
    plain: dict[str, list[int]] = {}  # task -> plain greedy tokens (the bound's)
    for rnd in range(rounds + 1):  # round 0 warms up (not kept)
        for name, ids in prompts.items():
            shift = rnd % len(settings)
            got = {}
            for setting in settings[shift:] + settings[:shift]:
                mode, k = (setting, None) if setting in ("off", "draft") else ("lookup", int(setting[1:]))
                tok_s, tokens, spec = run_case(gen, ids, mode, new_tokens, k, costs.get(setting),
                                               draft if mode == "draft" else None)
                got[setting] = tokens
                if rnd:
                    speeds[name][setting].append(tok_s)
                if spec is not None:
                    stats[name][setting] = spec | {"new_tokens": len(tokens), "prompt_tokens": len(ids)}
            plain[name] = got["off"]
            for setting, tokens in got.items():  # recorded, and the run fails at the end (exit 1)
                if tokens != got["off"]:
                    first = next((i for i, (a, b) in enumerate(zip(got["off"], tokens, strict=False)) if a != b),
                                 min(len(got["off"]), len(tokens)))
                    differ.setdefault(f"{name} {setting}", first)
        print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    # the oracle's ratio per task and k_max, at verification costs measured after the task's prompt and half its
    # plain output (the mean context of its decoding)
    curves = {name: measure_curve(gen, prompts[name] + plain[name][:len(plain[name]) // 2], max(ks))
              for name in TASKS}
    bounds = {name: {f"k{k}": bound(prompts[name], plain[name], curves[name][:k + 1])[0] for k in ks}
              for name in TASKS}
    return {"speeds": speeds, "stats": stats, "load": os.getloadavg(), "differ": differ, "bounds": bounds,
            "costs": curves}


def table(directory: Path, res: dict) -> list[str]:
    """Per task: plain tok/s, then per lookup setting its tok/s, its ratio to plain (median of the per-round
    ratios, min-max) and accepted/drafted tokens of its last run."""
    lines = [f"{directory}  (decode tok/s, median of rounds; load avg {res['load'][0]:.1f}/{res['load'][2]:.1f})"]
    settings = [s for s in next(iter(res["speeds"].values())) if s != "off"]
    ratios: dict[str, dict[str, list[float]]] = {s: {"grounded": [], "free": []} for s in settings}
    bounds: dict[str, dict[str, list[float]]] = {s: {"grounded": [], "free": []} for s in settings}
    for name, (group, _) in TASKS.items():
        s = res["speeds"][name]
        cells = [f"plain {statistics.median(s['off']):.1f}"]
        for setting in settings:
            per_round = [b / a for a, b in zip(s["off"], s[setting], strict=True)]
            r = statistics.median(per_round)
            ratios[setting][group].append(r)
            st = res["stats"][name].get(setting, {})
            b = res["bounds"][name].get(setting, float("nan"))
            bounds[setting][group].append(b)
            cells.append(f"{setting} {statistics.median(s[setting]):.1f} {r:.2f}x ({min(per_round):.2f}-"
                         f"{max(per_round):.2f}) {st.get('accepted')}/{st.get('drafted')}"
                         + (f" bound {b:.2f}x" if setting != "draft" else ""))  # the oracle's is lookup's
        lines.append(f"  {name:<10} {group:<9} " + " | ".join(cells))
    for name, at in res["differ"].items():
        lines.append(f"  {name}: TOKENS DIFFER from plain greedy from new token {at}")
    if not res["differ"]:
        lines.append("  every task and setting: the same greedy tokens as plain decoding, every round")
    for setting, by_group in ratios.items():
        for group, rs in by_group.items():
            lines.append(f"  {setting} {group}: median ratio {statistics.median(rs):.2f}x "
                         f"(tasks {', '.join(f'{r:.2f}' for r in rs)})"
                         + (f"; oracle bound median {statistics.median(bounds[setting][group]):.2f}x"
                            if setting != "draft" else ""))
    for name, curve in res["costs"].items():
        lines.append(f"  {name}: a verification of k = 1, 2, 4, 8, 16 drafts costs "
                     + ", ".join(f"{curve[k]:.2f}" for k in (1, 2, 4, 8, 16) if k < len(curve)) + " plain steps")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=None, metavar="K",
                    help="lookup's k_max, one setting per K (default: the runtime's DRAFT_TOKENS)")
    ap.add_argument("--draft", type=Path, help="also --speculative draft with this export as the drafter")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from edgellm.runtime.draft_length import DRAFT_TOKENS

    ks = args.draft_tokens or [DRAFT_TOKENS]
    results = {}
    for directory in args.exports:
        results[str(directory)] = bench(directory, args.rounds, args.new_tokens, args.threads, ks, args.draft)
        for line in table(directory, results[str(directory)]):
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if any(r["differ"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
