"""Where a lone decode row differs from the same row in a verification (onnxruntime's 4-bit MatMulNBits on an
AVX2-only x86: its one-row kernel sums in another order), could greedy speculation be exact by never running a
lone row? Every step then runs >= 2 rows through the lone-row stack: the token plus a guess (lookup's draft, else
the token again), so each decode row is a verification row bit for bit. This measures what that costs
(issue 26; not shipped: a two-row int4 step costs ~1.3x a lone one).

    python bench/two_row_steps.py EXPORT [--rounds 2] [--new-tokens 128]

Per task of bench/speculative.py (chat template, greedy): decode tok/s of plain lone-row decoding, of two-row
steps with no drafting, and of two-row steps with prompt lookup (k from the tokens alone, `timed=False`); and
whether the two two-row modes give the same tokens (they must: every row is a verification row) and whether
those equal plain lone-row decoding's (they need not). Runs the runtime's own speculative loop with a drafter
that never proposes nothing and a draft length of at least one.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from speculative import TASKS

import edgellm.runtime.generator as generator_module
import edgellm.runtime.speculative as speculative_module
from edgellm.runtime.draft_length import Adaptive
from edgellm.runtime.drafting import PromptLookup
from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig

LOOKUP = {"on": True}   # two-row steps: draft by lookup (True) or only ever guess the last token again (False)


class AtLeastOne(Adaptive):
    def budget(self) -> int:
        k = super().budget()
        return max(k, 1) if LOOKUP["on"] else 1


class GuessAlways(PromptLookup):
    def propose(self, k: int) -> list[int]:
        return (super().propose(k) if LOOKUP["on"] else []) or [self.tokens[-1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    gen = Generator.open(args.export, config=SessionConfig(threads=2, shared_pool=True, exact=False))
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    modes = ("plain", "two", "two+lookup")
    speeds = {t: {m: [] for m in modes} for t in TASKS}
    tokens: dict[str, dict[str, list[int]]] = {t: {} for t in TASKS}
    plain_classes = (speculative_module.Adaptive, generator_module.PromptLookup)
    for r in range(args.rounds + 1):   # round 0 warms up
        for task, ids in prompts.items():
            for mode in modes[r % 3:] + modes[:r % 3]:
                two = mode != "plain"
                speculative_module.Adaptive, generator_module.PromptLookup = (
                    (AtLeastOne, GuessAlways) if two else plain_classes)
                LOOKUP["on"] = mode == "two+lookup"
                gen.speculate("lookup" if two else "off", timed=False)
                out = gen.complete(ids, SamplingParams(temperature=0), StopParams(args.new_tokens), text=False)
                if r:
                    speeds[task][mode].append(out.timings.decode_tok_s)
                tokens[task][mode] = out.token_ids
    speculative_module.Adaptive, generator_module.PromptLookup = plain_classes
    print(f"{args.export} ({gen.engine.stack_role}), decode tok/s, median of {args.rounds} rounds")
    for task in TASKS:
        m = {mode: statistics.median(v) for mode, v in speeds[task].items()}
        same = tokens[task]["two"] == tokens[task]["two+lookup"]
        print(f"  {task:10s} plain {m['plain']:6.1f} | two rows {m['two']:6.1f} ({m['two'] / m['plain']:.2f}x) | "
              f"two rows + lookup {m['two+lookup']:6.1f} ({m['two+lookup'] / m['plain']:.2f}x) | two-row modes "
              f"{'same' if same else 'DIFFER'}; vs plain lone rows: "
              f"{'same' if tokens[task]['two'] == tokens[task]['plain'] else 'differ'}")


if __name__ == "__main__":
    main()
