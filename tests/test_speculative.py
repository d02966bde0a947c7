"""Speculative decoding (runtime/speculative.py, drafting.py): greedy output equal to plain greedy decoding token
for token on every preset and layout (layer graphs rows / inplace with the paired stack + head, one model graph),
with drafts actually accepted; the draft-export drafter; off on ring caches; sampled speculation giving plain
sampling's tokens for a seed; the CLI's
flags; costs kept across mode switches. The drafter and the acceptance rules alone: tests/test_speculative_policy.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.export import ExportOptions, export_model
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import greedy_steps, tiny_model

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
    gen = Generator.open(out, config=SessionConfig(exact=True))   # plain decoding through the spare-row stack too
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
    kernels with int8 activations alike (where this CPU's 4-bit kernel is row-exact, tests/rows_helpers.py)."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.manifest import read_manifest
    from tests.quant_helpers import quantize
    from tests.rows_helpers import assert_rows_exact

    def split(src: Path) -> Path:   # the --bits 4 default head: int8 and int4 rows, one GatherElements
        return quantize(src, tmp_path / "split", bits=4, method="rtn", lm_head="int8", head_int8_rows=0.3,
                        calibration_tokens=64)
    tied = lambda: export(tmp_path, "llama2", "layer", "fused", tie_embeddings=True)  # noqa: E731
    out = {"fp32": lambda: llama, "int4": lambda: quantize(llama, tmp_path / "int4", bits=4, method="rtn"),
           "fp32-tied": tied, "int4-split-head": lambda: split(llama),
           "int4-split-tied": lambda: split(tied())}[case]()
    engine = Engine.open(out, read_manifest(out), SessionConfig(exact=True))   # the spare-row stack
    fed, steps = greedy_steps(engine, PROMPT, 24)
    rows = np.concatenate([engine.few_rows(fed[i:i + 8]).copy() for i in range(0, len(fed), 8)])
    assert engine.any_rows
    assert assert_rows_exact(engine, rows, steps) or not case.startswith("fp32")   # fp32: always exact


def test_verifications_of_any_size_share_one_logits_buffer(llama: Path) -> None:
    """`few_rows` writes rows [0, n) of one logits buffer for every n (`reserve_rows`; a larger call grows it
    and rebuilds the variants bound so far), and each call still returns the decode steps' logits."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.manifest import read_manifest

    engine = Engine.open(llama, read_manifest(llama), SessionConfig(exact=True))
    fed, steps = greedy_steps(engine, PROMPT, 18)
    engine.reserve_rows(4)
    rows, at = [], 0
    for n in (3, 2, 4, 3, 6):
        rows.append(engine.few_rows(fed[at:at + n]).copy())
        at += n
        if n == 3 and len(engine._few) == 3:  # sizes 3, 2, 4: three variants, one buffer of 4 rows
            assert engine._few_logits.shape[1] == 4
            assert all(np.shares_memory(v.logits, engine._few_logits) for v in engine._few.values())
    assert set(engine._few) == {6} and engine._few_logits.shape[1] == 6  # grown once, the old variants dropped
    assert np.array_equal(np.concatenate(rows), steps)


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
    drafter = gen._draft
    # the draft runs the lone-row stack (its rows match nothing, only its speed counts), and a new context is
    # fed to its cache when the generation starts, not at the first verification (whose measured cost it was)
    assert drafter.engine.stack_role == "stack_lone" and gen.engine.stack_role == "stack"
    drafter.reset(PROMPT[:10])
    assert drafter.cache.length == 10 and list(drafter.fed[:10]) == PROMPT[:10]
    drafter.reset(PROMPT[:6] + [1, 2])  # only what differs from the fed prefix is fed again
    assert drafter.cache.length == 8 and list(drafter.fed[:8]) == PROMPT[:6] + [1, 2]
    drafter.reset(PROMPT[:10])
    drafter.engine._few.clear()    # forget the S = n runs the generation above bound
    drafter.extend(PROMPT[10:12])  # a draft accepted whole: its last token and the one after it, fed in one S = 2 run
    caught_up = drafter.propose(4)
    assert 2 in drafter.engine._few and drafter.cache.length == 12 + 3
    drafter.reset(PROMPT[:12])     # the same context fed as a prompt (the prefill graph)
    assert drafter.propose(4) == caught_up
    # tokens decoded while drafting paused: `sync` (before a verification's timer) feeds all but the last
    drafter.reset(PROMPT[:12])
    drafter.extend(PROMPT[12:20])
    drafter.sync()
    assert drafter.cache.length == 19 and list(drafter.fed[:19]) == PROMPT[:19]
    drafter.sync()                 # nothing left to catch up on: no feed
    assert drafter.cache.length == 19
    synced = drafter.propose(4)
    drafter.reset(PROMPT[:20])     # the same context fed as a prompt
    assert drafter.propose(4) == synced
    gen.speculate("off")
    gen.speculate("draft", draft=llama)
    assert gen._draft is drafter   # the open draft export is kept across mode switches, not opened again
    other = export(tmp_path, "llama2", "layer", "fused", seed=1, n_layers=1)  # a different model, same vocab
    got, stats = greedy_ids(gen, "draft", draft=other, draft_tokens=3)
    assert got == plain and stats["drafted"] > 0 and gen._draft is not drafter
    small = export(tmp_path, "llama2", "layer", "fused", vocab_size=128)
    with pytest.raises(EdgeError, match="vocabulary of 128 tokens, the target has 256"):
        gen.speculate("draft", draft=small)
    with pytest.raises(EdgeError, match="draft: needed by `speculative` 'draft'"):
        gen.speculate("draft")


def test_sampled_speculation_gives_plain_samplings_tokens(llama: Path) -> None:
    """For point-mass drafts, rejection sampling draws each row's token as plain sampling does (one uniform per
    emitted token) and accepts a draft iff it is that token: on the exact stack the text is plain sampling's for
    the seed whatever k was (drafts of up to 2 or 32), repetition penalty and filters included. A low temperature
    keeps the tiny model's text looping, so drafts are accepted and rejected."""
    gen = Generator.open(llama)
    params = SamplingParams(temperature=0.05, top_k=20, top_p=0.9, repetition_penalty=1.02)
    for seed in (11, 12):
        gen.speculate("off")
        plain = gen.complete(PROMPT, params, StopParams(NEW, seed=seed), ignore_eos=True, text=False).token_ids
        work = set()
        for k_max in (2, 32):
            gen.speculate("lookup", draft_tokens=k_max)
            got = gen.complete(PROMPT, params, StopParams(NEW, seed=seed), ignore_eos=True, text=False)
            assert got.token_ids == plain
            assert 0 < got.speculative["accepted"] < got.speculative["drafted"]
            work.add((got.speculative["drafted"], got.speculative["verifications"]))
        assert len(work) == 2  # other drafts and verifications, the same text


def test_sampled_draft_export_draws_its_drafts(llama: Path) -> None:
    """In a sampled run a draft export draws each draft from its own sampling distribution q (the run's filters
    and repetition penalty) and hands q to rejection sampling, which accepts with probability sum(min(p, q)): the
    target as its own draft (q = p up to the two stacks' rounding) has nearly every draft accepted at a temperature
    where a point mass on its greedy pick would mostly be rejected (p(d) of a near-flat distribution)."""
    gen = Generator.open(llama)
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, repetition_penalty=1.1)
    gen.speculate("draft", draft=llama, timed=False)
    got = gen.complete(PROMPT, params, StopParams(NEW, seed=3), ignore_eos=True, text=False)
    st = got.speculative
    assert len(got.token_ids) == NEW and st["drafted"] > 0 and st["accepted"] >= 0.9 * st["drafted"], st
    drafter = gen._draft
    drafter.reset(PROMPT)
    history = np.asarray(PROMPT, np.int64)
    drafts, q = drafter.propose_sampled(4, params, np.random.default_rng(0), history)
    assert q.shape == (4, 256) and np.allclose(q.sum(axis=1), 1.0)
    assert all(q[i, d] > 0 for i, d in enumerate(drafts))
    assert q.max() < 0.9  # near-flat at this temperature: a point-mass draft would be accepted with p(d) < 0.9
    assert drafter.propose_sampled(0, params, np.random.default_rng(0), history) == ([], None)


def test_sampled_speculation_reads_a_split_heads_columns(llama: Path, tmp_path: Path) -> None:
    """A head quantized by rows gives its logits in column order (runtime/columns.py): sampled acceptance reorders
    each row it reads, and the text is still plain sampling's for the seed."""
    from tests.quant_helpers import quantize

    out = quantize(llama, tmp_path / "split", bits=4, method="rtn", lm_head="int8", head_int8_rows=0.3,
                   calibration_tokens=64)
    gen = Generator.open(out)
    assert not gen.engine.columns.identity
    params = SamplingParams(temperature=0.05, top_k=20, top_p=0.9)
    gen.speculate("off")
    plain = gen.complete(PROMPT, params, StopParams(NEW, seed=5), ignore_eos=True, text=False).token_ids
    gen.speculate("lookup", timed=False)
    got = gen.complete(PROMPT, params, StopParams(NEW, seed=5), ignore_eos=True, text=False)
    assert got.token_ids == plain and got.speculative["accepted"] > 0


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
    costs = gen.costs
    gen.complete(PROMPT, GREEDY, StopParams(NEW), ignore_eos=True, text=False)
    assert costs is not None and costs.step_s is not None
    gen.speculate("off")
    gen.speculate("lookup")
    assert gen.costs is costs
    with pytest.raises(EdgeError):
        gen.speculate("draft", draft=tmp_path / "missing")
    assert (gen.speculative, gen.costs) == ("lookup", costs)
    gen.speculate("draft", draft=llama)
    assert gen.costs is not costs and gen.costs.step_s is None
    gen.speculate("lookup", timed=False)
    assert gen.costs is None
