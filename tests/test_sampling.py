"""The sampler: each filter against a brute-force definition, the chain against Hugging Face's warpers, and
the draw against the distribution it should follow (chi-square on 20k seeded draws)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.sampling import (
    SamplingParams,
    StopParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    greedy,
    sample,
    softmax,
)

# chi-square critical values at alpha = 0.001 by degrees of freedom (standard tables)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def probs64(logits: np.ndarray) -> np.ndarray:
    """Reference softmax in float64."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def order(logits: np.ndarray) -> list[int]:
    """Brute-force ranking: logit descending, then token id ascending."""
    return sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))


def kept(filtered: np.ndarray) -> set[int]:
    return set(np.flatnonzero(filtered != -np.inf).tolist())


logit_vectors = st.builds(
    lambda seed, n, scale: (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32),
    st.integers(0, 2**32 - 1), st.integers(1, 300), st.floats(0.01, 20))


# ----------------------------------------------------------------------------------------------- filters


def test_softmax_sums_to_one_and_masked_tokens_are_zero() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 5
    x[::7] = -np.inf
    p = softmax(x)
    assert p.dtype == np.float32
    assert abs(p.sum(dtype=np.float64) - 1) < 1e-6
    assert np.all(p[::7] == 0) and np.all(p[1::7] > 0)
    np.testing.assert_allclose(p, probs64(x), rtol=1e-5, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(logit_vectors, st.integers(0, 40), st.floats(0.01, 1.0), st.floats(0.0, 0.99), st.floats(0.05, 5))
def test_every_chain_gives_a_distribution(x: np.ndarray, k: int, p: float, m: float, t: float) -> None:
    y = apply_min_p(apply_top_p(apply_top_k(apply_temperature(x, t), k), p), m)
    probs = softmax(y)
    assert abs(probs.sum(dtype=np.float64) - 1) < 1e-5
    assert np.all(probs[y == -np.inf] == 0)
    assert np.all(y[y != -np.inf] > -np.inf) and 1 <= len(kept(y)) <= (k or x.size)
    assert greedy(x) in kept(y)  # the most likely token survives every filter


@settings(max_examples=200, deadline=None)
@given(logit_vectors, st.floats(0.001, 1.0))
def test_top_p_keeps_the_minimal_highest_probability_set(x: np.ndarray, p: float) -> None:
    keep = kept(apply_top_p(x, p))
    ranked = order(x)
    assert set(ranked[:len(keep)]) == keep  # a prefix of the ranking (ties: lower ids first)
    probs = probs64(x)
    mass = sum(probs[i] for i in keep)
    assert mass >= p - 1e-6  # enough mass ...
    assert mass - probs[ranked[len(keep) - 1]] < p + 1e-6  # ... and dropping the last kept token is too little


def test_top_p_by_hand_and_ties() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert kept(apply_top_p(x, 0.49)) == {0}
    assert kept(apply_top_p(x, 0.79)) == {0, 1}
    assert kept(apply_top_p(x, 0.81)) == {0, 1, 2}
    assert kept(apply_top_p(x, 1.0)) == {0, 1, 2, 3}
    assert kept(apply_top_p(np.zeros(4, np.float32), 0.5)) == {0, 1}  # equal logits: lowest ids


def test_top_p_on_a_flat_152k_vocab_searches_in_rounds() -> None:
    # near-uniform: 0.9 of the mass needs ~137k tokens, so every widening round of the search runs
    x = np.random.default_rng(1).standard_normal(152_000).astype(np.float32) * 0.1
    keep = kept(apply_top_p(x, 0.9))
    ranked = np.argsort(-x.astype(np.float64), kind="stable")
    assert keep == set(ranked[:len(keep)].tolist())
    probs = probs64(x)
    mass = probs[ranked[:len(keep)]].sum()
    assert mass >= 0.9 - 1e-6 and mass - probs[ranked[len(keep) - 1]] < 0.9 + 1e-6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=60), st.integers(1, 70))
def test_top_k_keeps_exactly_k_with_ties_to_lower_ids(values: list[int], k: int) -> None:
    x = np.array(values, np.float32)  # small integers: many ties
    assert kept(apply_top_k(x, k)) == set(order(x)[:k])


def test_top_k_by_hand() -> None:
    x = np.array([1, 3, 3, 3, 2, 3], np.float32)
    assert kept(apply_top_k(x, 2)) == {1, 2}
    assert kept(apply_top_k(x, 5)) == {1, 2, 3, 4, 5}
    assert apply_top_k(x, 0) is x and apply_top_k(x, 6) is x  # off
    np.testing.assert_array_equal(apply_top_k(x, 2)[[1, 2]], x[[1, 2]])  # kept logits unchanged


def test_min_p() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert kept(apply_min_p(x, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert kept(apply_min_p(x, 0.7)) == {0}        # threshold 0.35
    assert kept(apply_min_p(x, 0.0)) == {0, 1, 2, 3}


def test_temperature_edge_cases() -> None:
    x = np.array([1.0, 3.0, 2.0, 3.0, -np.inf], np.float32)
    rng = np.random.default_rng(0)
    assert sample(x, SamplingParams(temperature=0), rng) == 1  # argmax, lowest id among equal maxima
    for t in (1e-6, 1e-300):  # tiny: only the maxima keep any mass (1e-300 underflows float32)
        p = softmax(apply_temperature(x, t))
        np.testing.assert_allclose(p, [0, 0.5, 0, 0.5, 0], atol=1e-12)
    p = softmax(apply_temperature(x, 1e6))  # huge: uniform over the unmasked tokens
    np.testing.assert_allclose(p, [0.25, 0.25, 0.25, 0.25, 0], atol=1e-5)
    np.testing.assert_allclose(softmax(apply_temperature(x, 0.5)), probs64(x.astype(np.float64) / 0.5), rtol=1e-5)


def test_repetition_penalty_like_ctrl() -> None:
    x = np.array([2.0, -2.0, 0.5, 1.0, 0.0], np.float32)
    y = apply_repetition_penalty(x, [0, 1, 1, 1, 4], 2.0)  # id 1 three times: penalised once
    np.testing.assert_array_equal(y, [1.0, -4.0, 0.5, 1.0, 0.0])
    np.testing.assert_array_equal(x, [2.0, -2.0, 0.5, 1.0, 0.0])  # input untouched
    with pytest.raises(EdgeError, match="previous token ids"):
        apply_repetition_penalty(x, [5], 1.3)


def test_chain_matches_hugging_face_warpers() -> None:
    """Same order and semantics as HF generate, so diff reports compare like with like."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(2)
    for _ in range(20):
        x = (rng.standard_normal(500) * 3).astype(np.float32)
        prev = rng.integers(0, 500, 30)
        t, k, p, m, r = 0.7, int(rng.integers(5, 100)), float(rng.uniform(0.3, 0.95)), 0.02, 1.3
        ours = apply_repetition_penalty(x, prev, r)
        ours = apply_min_p(apply_top_p(apply_top_k(apply_temperature(ours, t), k), p), m)
        ids, scores = torch.from_numpy(prev)[None], torch.from_numpy(x.copy())[None]
        for proc in (lp.RepetitionPenaltyLogitsProcessor(r), lp.TemperatureLogitsWarper(t),
                     lp.TopKLogitsWarper(k), lp.TopPLogitsWarper(p), lp.MinPLogitsWarper(m)):
            scores = proc(ids, scores)
        assert kept(ours) == kept(scores[0].numpy())


# ------------------------------------------------------------------------------------------------ sample


def test_sample_is_deterministic_per_seed_and_leaves_logits_alone() -> None:
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    before = x.copy()
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1)

    def run(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [sample(x, params, rng, previous_ids=[1, 2, 3]) for _ in range(200)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    np.testing.assert_array_equal(x, before)


def expected_after(probs: np.ndarray, keep: list[int]) -> np.ndarray:
    out = np.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


BASE = np.array([0.22, 0.18, 0.15, 0.12, 0.1, 0.08, 0.06, 0.05, 0.03, 0.01])
CASES = [  # (params, token ids the truncated distribution keeps, found by hand from BASE)
    (SamplingParams(), list(range(10))),
    (SamplingParams(top_k=4), [0, 1, 2, 3]),
    (SamplingParams(top_p=0.6), [0, 1, 2, 3]),          # 0.55 < 0.6 <= 0.67
    (SamplingParams(min_p=0.3), [0, 1, 2, 3, 4, 5]),    # p >= 0.3 * 0.22 = 0.066
    (SamplingParams(top_k=8, top_p=0.9, min_p=0.2), [0, 1, 2, 3, 4, 5, 6]),  # top-p over 8 renormalised
]


@pytest.mark.parametrize("params,keep", CASES)
def test_draws_follow_the_renormalised_truncated_distribution(params: SamplingParams, keep: list[int]) -> None:
    x = np.log(BASE).astype(np.float32)
    rng = np.random.default_rng(1234)
    n = 20_000
    counts = np.bincount([sample(x, params, rng) for _ in range(n)], minlength=10)
    want = expected_after(BASE, keep)
    assert np.all(counts[want == 0] == 0)
    chi2 = float((((counts - n * want) ** 2)[keep] / (n * want[keep])).sum())
    assert chi2 < CHI2_999[len(keep) - 1], (counts, n * want)


def test_draws_across_cdf_blocks_of_a_large_vocab() -> None:
    # mass on tokens at block edges of the two-level CDF, with and without -inf tokens
    v = 5000
    ids = [0, 1023, 1024, 2047, 2048, 4999]
    base = np.array([0.1, 0.2, 0.15, 0.25, 0.2, 0.1])
    for masked in (False, True):
        x = np.full(v, -60.0, np.float32)  # finite but ~e-26 each: never drawn in 10k tries
        if masked:
            x[1::2] = -np.inf
            x[[1023, 2047, 4999]] = -60.0
        x[ids] = np.log(base)
        rng = np.random.default_rng(5)
        got = np.array([sample(x, SamplingParams(), rng) for _ in range(10_000)])
        assert set(np.unique(got).tolist()) <= set(ids)
        counts = np.array([(got == i).sum() for i in ids])
        chi2 = float(((counts - 10_000 * base) ** 2 / (10_000 * base)).sum())
        assert chi2 < CHI2_999[5], counts


def test_sample_rejects_bad_logits() -> None:
    rng = np.random.default_rng(0)
    for bad in (np.array([0.0, np.nan]), np.full(3, -np.inf), np.array([0.0, np.inf]), np.zeros((2, 3)), np.zeros(0)):
        with pytest.raises(EdgeError, match="sample"):
            sample(bad, SamplingParams(), rng)


# ------------------------------------------------------------------------------------------------ params


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1}, {"top_k": 2.5}, {"top_p": 0.0},
    {"top_p": 1.01}, {"min_p": 1.0}, {"min_p": -0.1}, {"repetition_penalty": 0.0},
])
def test_sampling_params_validate(kwargs: dict) -> None:
    """The message starts with the parameter's name (the CLI turns it into the flag)."""
    with pytest.raises(EdgeError, match=f"^{next(iter(kwargs))}: expected"):
        SamplingParams(**kwargs)


def test_stop_params_and_dict_round_trip() -> None:
    with pytest.raises(EdgeError, match="^max_new_tokens: "):
        StopParams(max_new_tokens=-1)
    with pytest.raises(EdgeError, match="^seed: "):
        StopParams(seed=True)
    with pytest.raises(EdgeError, match="^stop: "):
        StopParams(stop=("",))
    assert StopParams(max_new_tokens=0, seed=3, stop=("\n\n",)).rng().integers(1 << 30) == \
        np.random.default_rng(3).integers(1 << 30)
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    assert SamplingParams.from_dict(p.to_dict(), "sampler") == p
    with pytest.raises(EdgeError, match=r"sampler: unknown sampling setting\(s\) \['do_sample'\]"):
        SamplingParams.from_dict({"do_sample": True}, "sampler")
    with pytest.raises(EdgeError, match="sampler: top_p: "):
        SamplingParams.from_dict({"top_p": "0.9"}, "sampler")
