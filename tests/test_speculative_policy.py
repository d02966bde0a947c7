"""Speculative decoding without a model (runtime/drafting.py, draft_length.py, speculative.py): what prompt lookup drafts
(the latest match, loops, resuming a broken copy), greedy acceptance, the adaptive's accept rate, costs, draft
lengths and pauses, and rejection sampling that keeps the sampling distribution (a statistical test on fixed
distributions and seeds). Through exports: tests/test_speculative.py."""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.runtime.draft_length import DECAY, FREE_DRAFTS, NEAR_BEST, Adaptive, Costs
from edgellm.runtime.drafting import PromptLookup
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.sampling import SamplingParams, filtered, softmax
from edgellm.runtime.speculative import accept_greedy, accept_sampled


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    d = PromptLookup(min_ngram=1)
    d.reset([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert d.propose(4) == []          # "8" never occurred before
    d.extend([2, 3])                   # suffix 8 2 3: no 3-gram match, "2 3" latest at ... 2 3 -> 7 8 2 3
    assert d.propose(4) == [7, 8, 2, 3]
    d.extend([4])                      # suffix 2 3 4 (3-gram) occurred once: followed by 5 9 2 3
    assert d.propose(3) == [5, 9, 2]
    d.reset([6, 6])
    assert d.propose(5) == [6] * 5     # a loop ("6" after "6"): the copy runs on over itself
    d.reset([1, 9, 7, 8, 9, 7, 8])     # "9 7 8" again, 3 tokens after the first: a loop of period 3
    assert d.propose(7) == [9, 7, 8, 9, 7, 8, 9]
    d.reset([1, 7, 8, 9, 7, 8])        # only "7 8" of the period 3 repeated: no loop, the continuation stops
    assert d.propose(7) == [9, 7, 8]
    two = PromptLookup()               # the default: matches of 2 to 6 tokens
    two.reset([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2])
    assert two.propose(4) == [] and (two.extend([3]) or two.propose(2)) == [7, 8]
    # the longest earlier match wins over a later, shorter one: "a b c d e" -> f, then "x d e" -> y, and now
    # "a b c d e" again: the 5-gram points at f, though "d e" last led to y
    a, b, c, dd, e, f, x, y = range(10, 18)
    two.reset([a, b, c, dd, e, f, x, dd, e, y, a, b, c, dd, e])
    assert two.propose(2) == [f, x]
    short = PromptLookup(max_ngram=2)
    short.reset([a, b, c, dd, e, f, x, dd, e, y, a, b, c, dd, e])
    assert short.propose(2) == [y, a]


def test_prompt_lookup_resumes_a_broken_copy_where_the_text_picks_it_up() -> None:
    """After a copy breaks (a comma inserted, a word dropped or changed), the suffix is looked for first a few
    tokens on in the passage being copied: there a single token is enough, and it wins over a longer suffix's
    latest occurrence elsewhere."""
    first, second = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]
    prompt = [99, 21, 50, 51] + first + second       # "99 21" once before, followed by "50 51"
    d = PromptLookup()
    d.reset(prompt)
    d.extend([10, 11])
    assert d.propose(3) == [12, 13, 14]               # copying the first sentence
    d.extend([12, 13, 14])                            # accepted: the copy goes on in sync
    assert d.propose(2) == [20, 21]
    d.extend([99, 21])                                # the text wrote "99" for "20" and goes on with "21"
    assert d.latest() == (2, 2)                       # the latest "99 21" would draft "50 51"
    assert d.propose(3) == [22, 23, 24]               # resumed after "21" in the passage being copied
    d.extend([22, 23, 77])                            # a changed word, then a plain step
    d.extend([24])                                    # the passage goes on one token later
    assert d.propose(2) == [25, 10]                   # ("25" ends the prompt: the generated text follows)
    old = PromptLookup(window=0)                      # without resuming: only the latest occurrence of >= 2
    old.reset(prompt + [10, 11, 12, 13, 14, 99, 21])
    assert old.propose(3) == [50, 51, 10]
    # an inserted token: nothing near the passage matches it, and the copy resumes once the text does
    d.reset(prompt + [10, 11, 12, 13, 14, 98])
    d.source = len(first) + 4                         # (reset forgets it) the copy in progress expects "20"
    assert d.propose(2) == []                         # "14 98" and "98" occur nowhere
    d.extend([20])
    assert d.propose(2) == [21, 22]
    with pytest.raises(EdgeError, match="resume window"):
        PromptLookup(window=-1)


def test_accept_greedy() -> None:
    rows = np.zeros((4, 10), np.float32)
    rows[0, 3] = rows[1, 5] = rows[2, 1] = rows[3, 8] = 1.0
    assert accept_greedy([3, 5, 1], rows) == (3, 8)   # all accepted, then the bonus row's argmax
    assert accept_greedy([3, 4, 1], rows) == (1, 5)   # stops at the first disagreement, with the target's token
    assert accept_greedy([], rows) == (0, 3)


def test_adaptive_counts_breaks_not_the_unaccepted_tail() -> None:
    # the chance a draft token is accepted = hits / (hits + breaks), each decayed per verification; a draft
    # accepted whole is no evidence against a longer one
    a = Adaptive(k_max=8)  # untimed
    hits, breaks = a.hits, a.breaks
    for k, accepted in [(4, 4), (6, 6), (8, 2), (4, 4)]:
        a.verified(k, accepted, 0.0)
        hits, breaks = DECAY * hits + accepted, DECAY * breaks + (accepted < k)
        assert a.rate == pytest.approx(hits / (hits + breaks))
    assert a.rate > 0.85  # the accepted/drafted EMA it replaced gave 0.78 here, and 5-token drafts next
    assert a.budget() >= 6  # every draft but one accepted whole: long drafts pay
    failures = 0
    while a.budget() > 0:  # drafts that keep failing: the chance falls until a draft costs more than it wins
        a.verified(8, 0, 0.0)
        failures += 1
        assert failures < 30
    assert failures >= 5  # one failure after a run of whole accepts does not stop drafting
    assert [a.budget() for _ in range(8)] == [0] * 8  # the pause
    assert a.budget() > 0  # then a probe, from an even guess


def test_adaptive_interpolates_the_measured_verification_costs() -> None:
    costs = Costs()
    a = Adaptive(k_max=8, costs=costs)
    assert a.budget() == 0  # the engine's first step is plain: costs are measured against it
    assert a.costs()[4] == pytest.approx(1.4)  # nothing measured: the fixed guess
    a.timed_step(0.010)
    a.verified(2, 2, 0.100)  # the first verification at a k is not a measurement (one-time costs)
    assert a.costs()[2] == pytest.approx(1.2)
    a.verified(6, 6, 0.100)
    a.verified(2, 2, 0.012)  # 1.2 plain steps
    a.verified(6, 6, 0.026)  # 2.6
    assert [a.costs()[k] for k in (2, 6)] == pytest.approx([1.2, 2.6])  # measured: as measured
    assert a.costs()[1] == pytest.approx(1.1)  # between a plain step (k = 0) and k = 2
    assert a.costs()[4] == pytest.approx(1.9)  # between k = 2 and k = 6
    assert a.costs()[8] == pytest.approx(3.3)  # past k = 6: that segment's 0.35 per draft row, not the guess's 0.1
    assert Adaptive(k_max=8).costs()[4] == pytest.approx(1.4)  # untimed: tokens alone decide k
    later = Adaptive(k_max=8, costs=costs)  # the next generation on the same engine: no plain step, no warm-up
    assert later.budget() > 0 and later.costs()[4] == pytest.approx(1.9)


def test_adaptive_drafts_the_fewest_tokens_near_the_best_gain() -> None:
    """Where draft rows are costly the expected gain is flat near its top and the adaptive drafts the fewest
    tokens within NEAR_BEST of the best; where rows are cheap and drafts are accepted whole, the longest."""
    def adaptive(k1_steps: float, k16_steps: float, hits: float, breaks: float) -> Adaptive:
        costs = Costs()
        a = Adaptive(k_max=16, costs=costs)
        a.timed_step(0.010)
        for _ in range(2):  # (the first verification at a k is a warm-up, not a measurement)
            for k, steps in ((1, k1_steps), (16, k16_steps)):
                costs.verification(k, 0.010 * steps)
        a.hits, a.breaks = hits, breaks
        return a

    costly = adaptive(1.3, 5.8, hits=9.0, breaks=1.0)  # int4-like rows (0.3 plain steps each), 90 % accepted
    gains = [costly.gain(k) for k in range(17)]
    k_top = max(range(1, 17), key=gains.__getitem__)
    k = costly.budget()
    assert k < k_top and gains[k] >= NEAR_BEST * gains[k_top]
    assert all(gains[j] < NEAR_BEST * gains[k_top] for j in range(1, k))
    assert adaptive(1.05, 1.8, hits=20.0, breaks=0.01).budget() >= 15  # fp32-like rows, drafts accepted whole


def test_drafts_past_free_drafts_are_earned_by_whole_accepts() -> None:
    """Up to FREE_DRAFTS the gain decides; past it a draft is at most the tokens accepted since the last break,
    so text copied whole reaches k_max and text that breaks every few tokens stays at k_max 16's choices."""
    costs = Costs()
    a = Adaptive(k_max=32, costs=costs)
    a.timed_step(0.010)
    for _ in range(2):  # cheap rows (fp32-like): the gain grows up to k_max for drafts accepted whole
        for k in (1, 32):
            costs.verification(k, 0.010 * (1.0 + 0.05 * k))
    a.hits, a.breaks = 50.0, 0.01
    assert FREE_DRAFTS - 3 <= a.budget() <= FREE_DRAFTS  # no copy run yet: capped (NEAR_BEST: a few fewer)
    a.verified(FREE_DRAFTS, FREE_DRAFTS, 0.018)
    a.verified(12, 12, 0.016)
    assert a.streak == 28 and FREE_DRAFTS < a.budget() <= 28  # 28 accepted whole: drafts of up to 28
    a.verified(28, 5, 0.024)  # a break
    assert a.streak == 0 and a.budget() <= FREE_DRAFTS
    a.verified(10, 10, 0.015)
    assert a.budget() <= FREE_DRAFTS  # 10 since the break: not yet past 16


def test_a_pause_ends_in_a_real_probe_even_when_the_costs_say_no() -> None:
    """Estimates change only through verifications: after a pause the adaptive drafts once whatever the costs
    say, so costs measured high once (a busy machine) cannot switch speculation off for good; a failed probe
    doubles the next pause."""
    costs = Costs()
    a = Adaptive(k_max=8, costs=costs)
    a.timed_step(0.010)
    for _ in range(2):  # (the first verification at a k is a warm-up, not a measurement)
        for k in (1, 8):  # each draft row costs 2 plain steps: no accept rate pays for that
            a.verified(k, k, 0.010 * (1 + 2 * k))
    assert max(a.gain(k) for k in range(1, 9)) < 1.0
    assert a.budget() == 0 and a.wait == 8  # a pause
    assert [a.budget() for _ in range(8)] == [0] * 8
    assert a.budget() == 1  # the probe: the cheapest k, though its estimated gain is < 1
    a.verified(1, 0, 0.030)
    assert [a.budget() for _ in range(17)] == [0] * 17 and a.budget() == 1  # failed: a pause twice as long


def first_token_counts(logits: np.ndarray, params: SamplingParams, draft_of, n: int, seed: int) -> np.ndarray:
    """How often each token came first out of `accept_sampled` over n trials (one draft per trial)."""
    rng = np.random.default_rng(seed)
    rows = np.stack([logits, logits])
    counts = np.zeros(logits.size, np.int64)
    for _ in range(n):
        d, q = draft_of(rng)
        accepted, after = accept_sampled([d], rows, params, rng, np.zeros(0, np.int64), q)
        counts[d if accepted else after] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("drafter", ["point", "model"])
def test_rejection_sampling_keeps_the_distribution(params: SamplingParams, drafter: str) -> None:
    logits = np.random.default_rng(3).normal(0, 1.5, 12).astype(np.float32)
    p = softmax(filtered(logits, params)).astype(np.float64)  # the distribution plain `sample` draws from
    q = softmax(np.random.default_rng(4).normal(0, 1.5, 12).astype(np.float32)).astype(np.float64)
    if drafter == "point":  # a deterministic drafter that always guesses the same (often wrong) token
        guess = int(np.argsort(p)[-2])

        def draft_of(rng):
            return guess, None
    else:                   # a draft model: the draft ~ q, accepted with min(1, p/q)

        def draft_of(rng):
            return int(rng.choice(12, p=q)), q[None, :]
    n = 20000
    freq = first_token_counts(logits, params, draft_of, n, seed=5) / n
    # every token within 5 standard errors of p (fixed seeds: deterministic), none outside p's support
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12), (freq, p)
    assert np.all(freq[p == 0] == 0)
    # and the drafts do get accepted (the point: fewer target steps), a rejection never returns the draft
    assert 0.5 * np.abs(freq - p).sum() < 0.02
