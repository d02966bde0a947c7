"""bench/speculative_bound.py: the oracle's ratio (the best any choice of draft lengths could do with prompt lookup
at given verification costs) on hand-checked cases, and never below what the runtime's own policy reaches on the
same tokens at the same costs (an untimed Generator: costs 1 + 0.1 k, the tokens alone choose k); the bench's
cost measurement leaves the generator as it found it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from tests.test_speculative import PROMPT, export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from speculative_bound import bound, lookup_matches, measure_curve  # noqa: E402

LINEAR = [1.0 + 0.1 * k for k in range(17)]  # the untimed Adaptive's cost model, k_max 16


def test_a_copied_run_is_drafted_from_its_second_token_and_verified_in_one_go() -> None:
    prompt = list(range(100, 140))
    tokens = prompt[10:30]  # 20 tokens copied from the prompt
    matches = lookup_matches(prompt, tokens, 16)
    # after one token nothing matches ("p39 p10" never occurred); after two the rest is proposed and accepted,
    # up to the runtime's room (max_new - emitted - 1) and k_max
    assert matches[1] == (0, 0)
    assert matches[2] == (16, 16) and matches[10] == (9, 9) and matches[18] == (1, 1)
    # plain step to i = 2 (1), then 16 drafts (2.6) -> i = 19, then one plain step (1): 19 steps' tokens in 4.6
    ratio, verifications = bound(prompt, tokens, LINEAR)
    assert ratio == pytest.approx(19 / 4.6) and verifications == 1


def test_no_verification_when_none_pays() -> None:
    prompt = list(range(100, 140))
    tokens = prompt[10:30]
    costly = [1.0] + [k + 1.5 for k in range(1, 17)]  # k drafts cost more than their k + 1 tokens
    assert bound(prompt, tokens, costly) == (1.0, 0)
    # text that never repeats the context: nothing to draft, plain decoding; nothing decoded: nothing to gain
    assert bound(prompt, list(range(200, 230)), LINEAR) == (1.0, 0)
    assert bound(prompt, prompt[10:11], LINEAR) == bound(prompt, [], LINEAR) == (1.0, 0)


def test_a_wrong_draft_is_never_verified() -> None:
    prompt = [1, 2, 3, 9, 9, 1, 2, 3, 7]
    tokens = [1, 2, 4, 5, 6]  # after "1 2" lookup proposes "3 7" (its latest occurrence), the text says 4
    matches = lookup_matches(prompt, tokens, 16)
    assert matches[2] == (2, 0) and matches[1] == matches[3] == matches[4] == (0, 0)
    assert bound(prompt, tokens, LINEAR) == (1.0, 0)


def test_the_runtime_policy_never_beats_the_bound(tmp_path: Path) -> None:
    gen = Generator.open(export(tmp_path, "llama2", "layer", "fused"))
    gen.speculate("off")
    plain = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(40), ignore_eos=True, text=False)
    gen.speculate("lookup", timed=False)
    spec = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(40), ignore_eos=True, text=False)
    tokens, stats = plain.token_ids, spec.speculative
    assert spec.token_ids == tokens and stats["accepted"] > 0
    # the policy's time in plain steps at LINEAR: a step per token not from a verification, 1 + 0.1 k per one
    steps = len(tokens) - 1
    plain_steps = steps - stats["accepted"] - stats["verifications"]
    policy = steps / (plain_steps + stats["verifications"] + 0.1 * stats["drafted"])
    ratio, _ = bound(PROMPT, tokens, LINEAR)
    assert policy > 1.0 and ratio >= policy - 1e-9
    # the bench's costs: one value per k, measured on the engine and leaving the generator's context empty
    curve = measure_curve(gen, PROMPT, 4, calls=2)
    assert len(curve) == 5 and curve[0] == 1.0 and all(c > 0 for c in curve)
    assert len(measure_curve(gen, PROMPT[:2], 4, calls=1)) == 5  # a prompt shorter than k + 1 rows
    assert gen.cache.length == 0
    again = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(40), ignore_eos=True, text=False)
    assert again.token_ids == tokens  # the engine is left as it was
