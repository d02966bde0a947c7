"""Speculative decoding (runtime/speculative.py, drafting.py): greedy output equal to plain greedy decoding token
for token on every preset and layout (layer graphs rows / inplace with the paired stack + head, one model graph),
with drafts actually accepted; the draft-export drafter; off on ring caches; rejection sampling that keeps the
sampling distribution (a statistical test on fixed distributions and seeds); same-seed reproducibility."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.export import ExportOptions, export_model
from edgellm.runtime.drafting import PromptLookup
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams, filtered, softmax
from edgellm.runtime.speculative import DECAY, NEAR_BEST, Adaptive, Costs, accept_greedy, accept_sampled
from tests.export_helpers import tiny_model

OPTIONS = dict(max_seq=96, prefill_chunk=8)
PRESETS = ["llama2", "from-scratch", "stellarbyte", "minicpm4", "qwen2", "qwen3", "mistral", "nanogpt", "gemma3"]
# (preset, granularity, attention): every preset in the default layout (inplace fused layers + stack + paired
# head: the S = k + 1 verification), and the other layouts on llama2 (verification through forward_rows)
SLOW = pytest.mark.slow  # the other presets: ~10 s each
CASES = [("llama2", "layer", "fused"), ("llama2", "layer", "standard"), ("llama2", "model", "standard"),
         ("gemma3", "layer", "fused")] + [pytest.param((p, "layer", "fused"), marks=SLOW)
                                          for p in PRESETS if p not in ("llama2", "gemma3")]
# a repeated random run: the prompt repeats itself, and the tiny models' greedy text soon loops too
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, 12)] * 3
GREEDY, NEW = SamplingParams(temperature=0), 40


def export(root: Path, preset: str, granularity: str, attention: str, seed: int = 0, **over) -> Path:
    out = root / f"{preset}-{granularity}-{attention}-{seed}"
    export_model(tiny_model(preset, seed=seed, **over), out,
                 ExportOptions(granularity=granularity, attention=attention, **OPTIONS), progress=False,
                 log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("spec"), "llama2", "layer", "fused")


def greedy_ids(gen: Generator, mode: str, prompt=PROMPT, **kw) -> tuple[list[int], dict | None]:
    gen.speculate(mode, timed=False, **kw)  # drafts from the tokens alone: the same on any machine and load
    r = gen.complete(prompt, GREEDY, StopParams(NEW), ignore_eos=True, text=False)
    return r.token_ids, r.speculative


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_greedy_speculation_gives_the_plain_tokens(case, tmp_path: Path) -> None:
    out = export(tmp_path, *case)
    gen = Generator.open(out)
    plain, none = greedy_ids(gen, "off")
    got, stats = greedy_ids(gen, "lookup")
    assert none is None and got == plain
    if case[0] == "gemma3" and case[2] == "fused":  # layer 0's ring cannot be rewound: speculation stays off
        assert any(gen.cache.ring) and stats is None
        return
    assert stats["accepted"] > 0 and stats["drafted"] >= stats["accepted"], stats
    assert gen.engine.any_rows == (case[1:] == ("layer", "fused"))
    # the context continues exactly where plain decoding leaves it (the cache rewound to the last token's rows)
    gen.speculate("off")
    gen.complete(PROMPT, GREEDY, StopParams(NEW - 7), ignore_eos=True, text=False)
    cont_plain = gen.complete([5], GREEDY, StopParams(8), ignore_eos=True, keep_context=True, text=False).token_ids
    gen.speculate("lookup")
    gen.complete(PROMPT, GREEDY, StopParams(NEW - 7), ignore_eos=True, text=False)
    cont = gen.complete([5], GREEDY, StopParams(8), ignore_eos=True, keep_context=True, text=False).token_ids
    assert cont == cont_plain


@pytest.mark.parametrize("case", ["fp32", "fp32-tied", "int4", "int4-split-head", "int4-split-tied"])
def test_verification_rows_are_the_decode_steps_bitwise(llama: Path, tmp_path: Path, case: str) -> None:
    """Why greedy speculation can be exact, not merely close: each row of a k + 1 row verification is computed
    bit for bit as the decode step of that token computes it (fused attention always runs >= 2 rows,
    export/fused.py; the head pre-packed, a tied fp32 table too: placement.py), in fp32 and through int4
    kernels with int8 activations alike."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.manifest import read_manifest
    from tests.quant_helpers import quantize

    def split(src: Path) -> Path:   # the --bits 4 default head: int8 and int4 rows, one GatherElements
        return quantize(src, tmp_path / "split", bits=4, method="rtn", lm_head="int8", head_int8_rows=0.3,
                        calibration_tokens=64)
    tied = lambda: export(tmp_path, "llama2", "layer", "fused", tie_embeddings=True)  # noqa: E731
    out = {"fp32": lambda: llama, "int4": lambda: quantize(llama, tmp_path / "int4", bits=4, method="rtn"),
           "fp32-tied": tied, "int4-split-head": lambda: split(llama),
           "int4-split-tied": lambda: split(tied())}[case]()
    engine = Engine.open(out, read_manifest(out))
    logits, fed, steps = engine.forward(PROMPT).copy(), [], []
    for _ in range(24):  # plain greedy decoding, one S = 1 step per token
        fed.append(int(logits.argmax()))
        logits = engine.forward(fed[-1:]).copy()
        steps.append(logits)
    engine.cache.rewind(len(PROMPT))
    rows = np.concatenate([engine.few_rows(fed[i:i + 8]).copy() for i in range(0, len(fed), 8)])
    assert engine.any_rows and np.array_equal(rows, np.stack(steps))


def test_verifications_of_any_size_share_one_logits_buffer(llama: Path) -> None:
    """`few_rows` writes rows [0, n) of one logits buffer for every n (`reserve_rows`; a larger call grows it
    and rebuilds the variants bound so far), and each call still returns the decode steps' logits."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.manifest import read_manifest

    engine = Engine.open(llama, read_manifest(llama))
    logits, fed, steps = engine.forward(PROMPT).copy(), [], []
    for _ in range(18):
        fed.append(int(logits.argmax()))
        logits = engine.forward(fed[-1:]).copy()
        steps.append(logits)
    engine.cache.rewind(len(PROMPT))
    engine.reserve_rows(4)
    rows, at = [], 0
    for n in (3, 2, 4, 3, 6):
        rows.append(engine.few_rows(fed[at:at + n]).copy())
        at += n
        if n == 3 and len(engine._few) == 3:  # sizes 3, 2, 4: three variants, one buffer of 4 rows
            assert engine._few_logits.shape[1] == 4
            assert all(np.shares_memory(v.logits, engine._few_logits) for v in engine._few.values())
    assert set(engine._few) == {6} and engine._few_logits.shape[1] == 6  # grown once, the old variants dropped
    assert np.array_equal(np.concatenate(rows), np.stack(steps))


def test_turns_ending_in_eos_leave_plain_decodings_context(tmp_path_factory) -> None:
    """Multi-turn (keep_context): a turn whose EOS comes right after accepted drafts leaves the context plain
    decoding leaves (the last token in the cache, nothing carried: it was fed twice on the next turn), and a
    verification that reached the cache's end does not cut the turn short ("length")."""
    from tests.runtime_fixtures import bigram_export

    gen = Generator.open(bigram_export(tmp_path_factory))

    def turns(mode: str) -> tuple[list[tuple], dict | None]:
        gen.speculate(mode, timed=False)
        gen.reset()
        out, stats = [], None
        for _ in range(9):  # 9 turns of ~8 rows fill the 64-row context
            r = gen.complete("a", GREEDY, StopParams(16), keep_context=True, text=False)
            out.append((r.finish_reason, r.prompt_ids, r.token_ids, gen.cache.length))
            stats = r.speculative or stats
        return out, stats

    plain, _ = turns("off")
    spec, stats = turns("lookup")
    assert spec == plain and stats["accepted"] > 0
    assert [t[0] for t in plain].count("eos") >= 7


def test_draft_export_drafter(llama: Path, tmp_path: Path) -> None:
    gen = Generator.open(llama)
    plain, _ = greedy_ids(gen, "off")
    same, stats = greedy_ids(gen, "draft", draft=llama)  # the target as its own draft: every draft is right
    assert same == plain and stats["accepted"] >= 0.8 * stats["drafted"] > 0, stats
    other = export(tmp_path, "llama2", "layer", "fused", seed=1, n_layers=1)  # a different model, same vocab
    got, stats = greedy_ids(gen, "draft", draft=other, draft_tokens=3)
    assert got == plain and stats["drafted"] > 0
    small = export(tmp_path, "llama2", "layer", "fused", vocab_size=128)
    with pytest.raises(EdgeError, match="vocabulary of 128 tokens, the target has 256"):
        gen.speculate("draft", draft=small)
    with pytest.raises(EdgeError, match="draft: needed by `speculative` 'draft'"):
        gen.speculate("draft")


def test_sampling_speculation_is_reproducible(llama: Path) -> None:
    gen = Generator.open(llama)
    gen.speculate("lookup")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1)
    runs = [gen.complete(PROMPT, params, StopParams(NEW, seed=11), ignore_eos=True, text=False) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].speculative["drafted"] > 0


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


def test_cli_flags(llama: Path, capsys) -> None:
    from edgellm.cli import main

    ids = ",".join(map(str, PROMPT))
    base = ["run", str(llama), "--prompt-ids", ids, "--max-new-tokens", "12", "--temperature", "0", "--json"]
    docs = {}
    for mode in ("off", "lookup"):
        assert main(base + ["--speculative", mode, "--draft-tokens", "4"]) == 0
        docs[mode] = json.loads(capsys.readouterr().out)
    assert docs["off"]["token_ids"] == docs["lookup"]["token_ids"] and "speculative" not in docs["off"]["stats"]
    assert docs["lookup"]["stats"]["speculative"]["mode"] == "lookup"
    assert main(base + ["--speculative", "draft", "--draft", str(llama)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == docs["off"]["token_ids"]
    assert main(["bench", str(llama), "--speculative", "lookup", "--runs", "1", "--new-tokens", "4", "--contexts", "8",
                 "--max-other-load", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["context"] == 8
    # auto (the default): lookup where verification rows are bit for bit decode steps (fused layers + stack: this
    # float export and its int8 quantization), off elsewhere (layers of standard ops)
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["speculative"]["mode"] == "lookup"
    q8 = llama.parent / "q8"
    if not q8.exists():
        assert main(["quantize", str(llama), "-o", str(q8), "--bits", "8", "--no-check", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["run", str(q8)] + base[2:]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["speculative"]["mode"] == "lookup" and doc["token_ids"] != []
    standard = export(llama.parent, "llama2", "layer", "standard")
    assert main(["run", str(standard)] + base[2:]) == 0
    assert "speculative" not in json.loads(capsys.readouterr().out)["stats"]
    for extra, message in ((["--speculative", "draft"], "--speculative draft: needs --draft DIR"),
                           (["--draft", str(llama)], "--draft: needs --speculative draft"),
                           (["--draft-tokens", "x"], "--draft-tokens: expected an integer, got 'x'"),
                           (["--draft-tokens", "0"], "--draft-tokens: expected an integer in 1..32")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


def test_verification_costs_outlive_a_mode_switch(llama: Path, tmp_path: Path) -> None:
    """The measured costs are the engine's: kept across "off"/"lookup" switches and generations, measured
    again for a draft export (its steps are part of a verification); a draft that fails to open changes nothing."""
    from edgellm.runtime.errors import EdgeError

    gen = Generator.open(llama)
    gen.speculate("lookup")
    costs = gen._costs
    gen.complete(PROMPT, GREEDY, StopParams(NEW), ignore_eos=True, text=False)
    assert costs is not None and costs.step_s is not None
    gen.speculate("off")
    gen.speculate("lookup")
    assert gen._costs is costs
    with pytest.raises(EdgeError):
        gen.speculate("draft", draft=tmp_path / "missing")
    assert (gen.speculative, gen._costs) == ("lookup", costs)
    gen.speculate("draft", draft=llama)
    assert gen._costs is not costs and gen._costs.step_s is None
    gen.speculate("lookup", timed=False)
    assert gen._costs is None
