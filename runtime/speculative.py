"""Speculative decoding: a drafter (drafting.py) guesses k tokens, one forward over the last token + the k
drafts (`Engine.few_rows`: the paired stack and head at S = k + 1, every row's logits) checks them all, and
the cache is rewound to the accepted rows (`KVCache.rewind`: the one cache rule; rejected rows stay in the
buffers past the length, never read, overwritten by the next writes). Each verification yields >= 1 token.

Acceptance (row i of the verification = the target's logits after the last token and drafts d_1..d_i):
- greedy (temperature 0): accept d_1..d_n while each equals row i-1's argmax, then row n's argmax. The tokens
  are those plain greedy decoding picks: where `Engine.exact_rows` holds (fused layers + stack, format 10) each
  verification row is bit for bit that token's decode step (export/fused.py: attention always runs >= 2 rows),
  fp32 and quantized alike; elsewhere (standard-op layers) up to float rounding, so a near-tie could break the
  other way, and the CLI's `auto` leaves speculation off there.
- sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023) against p = softmax of
  `sampling.filtered` (the very distribution `sample` draws from, repetition penalty included with the drafts
  as history): accept d with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q)). The drafters
  here are deterministic (q a point mass on d), and for a point mass that rule is "draw x from p; accept d iff
  x = d, else emit x" (accepted with probability p(d); a rejection emits p without d). Drawn by `sample` itself,
  one uniform per emitted token in order, as plain sampling draws them: every emitted token is plain sampling's
  token for the same seed (bit for bit where the rows are, `Engine.exact_rows`; the lone-row stack of sampled runs
  is not, so its text drifts from plain sampling's, in distribution the same), whatever k was. A drafter with a
  distribution q (none ships) takes the general rule: the same distribution, not the same tokens.

`Adaptive` keeps speculation from costing time: the chance a draft token is accepted and the measured cost of a
verification, drafting included (relative to a plain step; `Costs`, kept by the Generator across generations),
pick the fewest drafts within 5 % of the best expected tokens per unit of time (NEAR_BEST; past FREE_DRAFTS only
as many as the copy in progress has run since its last break); when even the best is
below a plain step, drafting pauses (8 steps, doubling up to 32 while probes keep failing: text that starts free
and then quotes its prompt gets back to drafting within a few dozen tokens). The chance is accepted tokens /
(accepted tokens + breaks), decayed per verification: a draft accepted whole ends in no break, so its length says
nothing against longer drafts (copied text breaks at a paraphrased comma, not at a fixed rate).
Ring caches (sliding-window layers) cannot be rewound: speculation is off for them (`speculation_off`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from time import perf_counter

import numpy as np

from .sampling import SamplingParams, apply_repetition_penalty, argmax_checked, filtered, sample, softmax

MODES = ("off", "lookup", "draft")
# Adaptive's estimate's memory: a verification's weight falls to 0.7^n n verifications later. Measured against the EMA of
# accepted / drafted it replaced (SmolLM2-135M, 4 alternating rounds, same tokens): fp32 repeat / correct / extract /
# code edit 1.05 / 0.98 / 1.12 / 1.06x, free-form 0.97-1.05x; int4 1.00 / 0.99 / 1.07 / 1.23x, free 0.99-1.07x
DECAY = 0.7
# default k_max. Where a draft row is cheap the longest drafts pay: SmolLM2-135M fp32 (17 rows ~1.8 plain steps),
# 16 vs 8 in one process, alternating, same tokens: repeat / correct / extract / code edit 1.01 / 1.36 / 1.03 / 1.10x,
# tips 1.01x; int4 (a row ~0.3 steps) 0.99-1.02x, as Adaptive drafts less there (NEAR_BEST). 32 (past FREE_DRAFTS
# only as earned, below) vs 16, one process, each with its own Costs (2026-11-26 night): fp32 text copied whole
# (correct) 1.09 / 1.11x, the other grounded tasks 0.98-1.03x, free-form 0.98-1.02x; int4 grounded 0.94-1.10x
DRAFT_TOKENS = 32
# Adaptive drafts the fewest tokens whose expected gain is within 5 % of the best k's. The gain model takes each draft
# token's chance as independent, but copied text breaks at a paraphrase, not at a rate: where the gain curve is flat
# near its top (costly rows: int4) the longer drafts win little in the model and lose rows in fact (SmolLM2 int4,
# k_max 16, the best k vs this: repeat 0.92x of k_max 8 vs 0.99x); where rows are cheap (fp32) the curve is steep
# and this still picks the longest
NEAR_BEST = 0.95
# drafts longer than this are earned: at most the tokens accepted since the last break, so text copied whole gets
# long drafts once a copy has run that far, and text that breaks every few tokens keeps k_max 16's choices. Without
# it k_max 32 drafted SmolLM2 int4's paraphrased copies in more, shorter-accepted verifications (0.83-0.96x of k_max
# 16; fp32 correct 1.17-1.57x); each k the adaptive tries is also one more noisy cost estimate (Costs)
FREE_DRAFTS = 16


def accept_tokens(drafts: Sequence[int], token_at: Callable[[int], int]) -> tuple[int, int]:
    """(drafts accepted, the token after them): row i's token is `token_at(i)`, the one plain decoding picks there,
    and a draft is accepted iff it is that token. The one rule for greedy and for point-mass sampling."""
    for i, d in enumerate(drafts):
        t = token_at(i)
        if t != d:
            return i, t
    return len(drafts), token_at(len(drafts))


def accept_greedy(drafts: Sequence[int], rows: np.ndarray,
                  token: Callable[[np.ndarray], int] = argmax_checked) -> tuple[int, int]:
    """`accept_tokens` for verification logits rows [len(drafts) + 1, V]; `token`: a row's greedy id
    (`Columns.token` for rows in a head's column order)."""
    return accept_tokens(drafts, lambda i: token(rows[i]))


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probabilities p [V] (any positive total): the inverse CDF at u ~ U[0, 1)."""
    cdf = np.cumsum(p, dtype=np.float64)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(p)[-1]))  # rounding at the top: the last token with mass


def target_probs(logits: np.ndarray, params: SamplingParams, history: np.ndarray) -> np.ndarray:
    """p [V] float64: the distribution `sampling.sample` draws from for these logits and previous ids."""
    x = apply_repetition_penalty(np.asarray(logits, np.float32), history, params.repetition_penalty)
    return softmax(filtered(x, params)).astype(np.float64)


def accept_sampled(drafts: Sequence[int], rows: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                   history: np.ndarray, q: np.ndarray | None = None) -> tuple[int, int]:
    """Speculative rejection sampling: (drafts accepted, the token after them). `history`: the ids before the
    verification's first row (the repetition penalty's), `q` [k, V]: the drafter's distributions, None for a
    deterministic drafter (a point mass on each draft: `accept_tokens` with each row's token drawn by `sample` as
    plain sampling draws it, one uniform of `rng` per emitted token)."""
    def seen(i: int) -> np.ndarray:  # the repetition penalty's ids before row i
        penalise = params.repetition_penalty != 1.0
        return np.concatenate([history, np.asarray(drafts[:i], np.int64)]) if penalise else history

    if q is None:
        return accept_tokens(drafts, lambda i: sample(rows[i], params, rng, seen(i)))
    for i, d in enumerate(drafts):
        p = target_probs(rows[i], params, seen(i))
        if rng.random() * q[i, d] < p[d]:   # u < p(d) / q(d), without dividing by a zero q
            continue
        r = np.maximum(p - q[i], 0.0)
        return i, draw(r if r.sum() > 0 else p, rng)
    return len(drafts), draw(target_probs(rows[len(drafts)], params, seen(len(drafts))), rng)


class Costs:
    """What a verification of k drafts costs against a plain step, measured on one Generator's engine and kept
    across its generations (the accept rate is the text's, the costs are the engine's): a later generation
    drafts from its second token on, with the curve it had. The first verification at each k is not recorded:
    it pays one-time costs (the variant's first Run; on SmolLM2 int4 ~10 % slower, on tiny models most of it)."""

    def __init__(self) -> None:
        self.step_s: float | None = None  # EMA seconds of a plain step
        self.row_s: dict[int, float] = {}  # k -> EMA seconds of a verification of k drafts (from the second on)
        self.warm: set[int] = set()       # the k verified once already

    def step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def verification(self, k: int, seconds: float) -> None:
        if k not in self.warm:
            self.warm.add(k)
            return
        old = self.row_s.get(k)
        self.row_s[k] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def curve(self, k_max: int) -> list[float] | None:
        """[k] -> a verification of k drafts in plain steps, k = 0..k_max: piecewise linear through (0, 1) and
        every k measured so far, past the largest with its last segment's slope; None before any is measured.
        A fixed guess for the k not drafted yet made int4, where a draft row costs ~0.3 plain steps, try every
        k up to 8 once at a loss (measured against that guess, SmolLM2-135M, 6 alternating rounds: int4 repeat /
        code edit / explain 1.11 / 1.09 / 1.08x, the other tasks 0.97-1.02x; fp32 0.95-1.02x)."""
        if self.step_s is None or not self.row_s:
            return None
        points = [(0, 1.0)] + sorted((j, max(t / self.step_s, 1.0)) for j, t in self.row_s.items())
        out, i = [], 1
        for k in range(k_max + 1):
            while i < len(points) - 1 and k > points[i][0]:
                i += 1  # the segment ending at the first measured k >= k (the last one past them all)
            (k0, c0), (k1, c1) = points[i - 1], points[i]
            slope = (c1 - c0) / (k1 - k0)
            out.append(c0 + slope * (k - k0) if k <= k1 else c1 + max(slope, 0.0) * (k - k1))
        return out


class Adaptive:
    """How many tokens to draft next (0: a plain step), from the drafts' accept rate and the measured costs."""

    def __init__(self, k_max: int, costs: Costs | None = None, pause: int = 8, max_pause: int = 32) -> None:
        """`costs` None: untimed, costs from the fixed model 1 + 0.1 k only, so k depends on the tokens alone (the
        same verifications on any machine and load). The text does not depend on k (greedy, point-mass sampling)."""
        self.k_max, self.measured, self.base_pause, self.max_pause = k_max, costs, pause, max_pause
        self.hits, self.breaks = 0.7, 0.3  # accepted drafts and rejections, decayed by DECAY per verification
        self.pause, self.wait = pause, 0
        self.streak = 0  # tokens accepted since the last break (FREE_DRAFTS)
        self.probe = False  # the first step after a pause drafts, whatever the estimates say (budget)

    @property
    def rate(self) -> float:
        """A draft token's chance to be accepted."""
        return self.hits / (self.hits + self.breaks)

    def costs(self) -> list[float]:
        """[k] -> a verification of k drafts in plain steps (`Costs.curve`; 1 + 0.1 k before any is measured)."""
        curve = self.measured.curve(self.k_max) if self.measured is not None else None
        return curve or [1.0 + 0.1 * k for k in range(self.k_max + 1)]

    def gain(self, k: int, costs: list[float] | None = None) -> float:
        """Expected tokens per plain step's time with k drafts (1 = plain decoding)."""
        a = min(self.rate, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (costs or self.costs())[k]

    def budget(self) -> int:
        if self.measured is not None and self.measured.step_s is None:
            return 0  # the engine's first step is plain: costs are measured against it, never guessed
        if self.wait > 0:
            self.wait -= 1
            return 0
        costs = self.costs()  # once per step, not once per k
        top_k = min(self.k_max, max(FREE_DRAFTS, self.streak))
        gains = [self.gain(k, costs) for k in range(1, top_k + 1)]
        top = max(gains)
        floor = min(top, max(NEAR_BEST * top, 1.0))  # never a k that loses to a plain step when one wins
        best = next(k for k, g in enumerate(gains, 1) if g >= floor)
        if self.probe:
            # a real probe: estimates change only through verifications, so one that judged every k a loss
            # (a cost measured while the machine was busy, a rate from other text) would never be corrected.
            # It costs at most one verification per pause (the drafter may have nothing to propose)
            self.probe = False
            return best
        if top < 1.0:
            self.wait, self.pause = self.pause, min(2 * self.pause, self.max_pause)
            self.hits, self.breaks = 1.0, 1.0  # the probe after the pause starts from an even guess
            self.probe = True
            return 0
        return best

    def timed_step(self, seconds: float) -> None:
        if self.measured is not None:
            self.measured.step(seconds)

    def verified(self, k: int, accepted: int, seconds: float) -> None:
        self.hits = DECAY * self.hits + accepted
        self.breaks = DECAY * self.breaks + (accepted < k)
        self.streak = self.streak + accepted if accepted == k else 0
        if self.measured is not None:
            self.measured.verification(k, seconds)
        if accepted > 0:
            self.pause = self.base_pause


class Stats:
    __slots__ = ("mode", "drafted", "accepted", "verifications")

    def __init__(self, mode: str) -> None:
        self.mode, self.drafted, self.accepted, self.verifications = mode, 0, 0, 0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "drafted": self.drafted, "accepted": self.accepted,
                "verifications": self.verifications}


def configure(gen, speculative: str, draft, draft_tokens: int, config, timed: bool = True) -> None:
    """`Generator.speculate`: check the flags, open the draft export (its vocabulary and tokenizer file must be
    the target's) and set the generator's mode. `timed` False: k from the tokens alone (costs 1 + 0.1 k)."""
    from pathlib import Path

    from .errors import need

    need(speculative in MODES, f"speculative: expected one of {', '.join(MODES)}, got {speculative!r}")
    need(isinstance(draft_tokens, int) and 1 <= draft_tokens <= 32,
         f"draft_tokens: expected an integer in 1..32, got {draft_tokens!r}")
    need((speculative == "draft") == (draft is not None), "draft: needed by `speculative` 'draft', and only there")
    model = None
    if speculative == "draft":  # opened first: a bad draft leaves the generator as it was
        from .drafting import DraftModel
        from .fileio import safe_join

        tok = gen.manifest.tokenizer
        target = safe_join(gen.directory, tok["file"]) if tok is not None else None
        model = DraftModel(Path(draft), gen.manifest.vocab_size, config or gen.engine.config, target)
    # costs measured so far stay valid while the engine and the drafter's own cost stay: kept across "off" /
    # "lookup" switches (a benchmark alternating them, a chat toggling it), measured again for a draft export
    no_draft_export = model is None and gen._draft is None  # before and after: the drafter's cost is unchanged
    keep = timed and no_draft_export and gen._costs is not None
    if not keep:
        gen._costs = Costs() if timed else None
    gen.speculative, gen.draft_tokens, gen._draft = speculative, draft_tokens, model
    if speculative != "off":
        gen.engine.reserve_rows(draft_tokens + 1)  # the last token + k drafts: every verification's logits


def speculation_off(cache) -> str | None:
    """Why speculation cannot run on this cache, or None."""
    return "sliding-window (ring) caches cannot be rewound" if any(cache.ring) else None


def speculative_tokens(gen, drafter, k_max: int, pick: Callable[[np.ndarray], int], logits: np.ndarray,
                       sampling: SamplingParams | None, rng: np.random.Generator, max_new: int,
                       stats: Stats) -> Iterator[int]:
    """The Generator's token source with speculation (its plain one is `Generator._plain_tokens`). Invariant
    at each yield: the token is picked, not fed; `gen.cache` holds rows [0, valid) of the context. The caller
    may stop at any yield (close()): the cache is then rewound to that token's `valid`. `sampling` None:
    greedy acceptance."""
    engine, cache, history = gen.engine, gen.cache, gen._history
    # sampling: untimed, the tokens alone choose k (measured costs did not pay there: SmolLM2 int4, T 0.7, one
    # process, timed / untimed grounded 0.87-1.05x, free-form 0.99-1.00x); the text does not depend on k either way
    adaptive = Adaptive(k_max, gen._costs if sampling is None else None)
    drafter.reset(history[:cache.length].tolist())
    valid = cache.length
    emitted = 0
    token = pick(logits)
    try:
        while True:
            drafter.extend((token,))
            valid = cache.length
            emitted += 1
            yield token
            # the token is fed with up to k drafts; the verification must leave >= 1 free row (see Generator)
            room = min(cache.free - 2, max_new - emitted - 1)
            k = min(adaptive.budget(), room) if room > 0 else 0
            t0 = perf_counter()  # a verification's cost includes drafting (a draft export's k steps)
            drafts = drafter.propose(k) if k > 0 else []
            start = cache.length
            if not drafts:
                logits = engine.forward_columns((token,))
                history[start] = token
                gen._carry = []
                adaptive.timed_step(perf_counter() - t0)
                token = pick(logits)
                continue
            k = len(drafts)
            rows = engine.few_columns([token, *drafts])   # the head's column order (Engine.columns)
            history[start:start + k + 1] = (token, *drafts)
            gen._carry = []
            if sampling is None:
                n, after = accept_greedy(drafts, rows, engine.columns.token)
            else:
                n, after = accept_sampled(drafts, engine.columns.vocab(rows), sampling, rng, history[:start + 1])
            cache.rewind(start + 1 + n)  # rejected rows: past the length, never read
            adaptive.verified(k, n, perf_counter() - t0)
            stats.drafted += k
            stats.accepted += n
            stats.verifications += 1
            for j in range(n):
                drafter.extend((drafts[j],))
                valid = start + 1 + j
                emitted += 1
                yield drafts[j]
            token = after
    finally:  # the caller stopped at a token whose row (and later ones) may be in the cache already
        if cache.length > valid:
            cache.rewind(valid)
