"""How many tokens to draft next: speculative decoding's draft-length policy (runtime/speculative.py runs it).

`Adaptive` keeps speculation from costing time: the chance a draft token is accepted and the measured cost of a
verification, drafting included (relative to a plain step; `Costs`, kept by the Generator across generations),
pick the fewest drafts within 5 % of the best expected tokens per unit of time (NEAR_BEST; past FREE_DRAFTS only
as many as the copy in progress has run since its last break); when even the best is
below a plain step, drafting pauses (8 steps, doubling up to 32 while probes keep failing: text that starts free
and then quotes its prompt gets back to drafting within a few dozen tokens). The chance is accepted tokens /
(accepted tokens + breaks), decayed per verification: a draft accepted whole ends in no break, so its length says
nothing against longer drafts (copied text breaks at a paraphrased comma, not at a fixed rate).
"""

from __future__ import annotations

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
