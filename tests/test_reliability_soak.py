"""Soak: generation to a full 512-token context (finish reason "length", every token still PyTorch's argmax,
never an index error), and 20 back-to-back full-context generations in one process: resident memory must not
grow by more than RSS_BOUND_MB after a warm-up, and a seed must give the same tokens every time. Plus
`edgellm run` at the context limit: a prompt longer than the context (error, or --truncate) and a context
that fills during generation (finish reason "length" at every boundary, never an index error)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest

from edgellm.cli import main
from edgellm.export import ExportOptions, export_model
from edgellm.runtime import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from tests.export_helpers import tiny_model, torch_logits
from tests.runtime_fixtures import tiny_export

MAX_SEQ = 512
RSS_BOUND_MB = 20.0  # growth allowed over 20 full-context generations after 2 warm-up ones
PROMPT = [1, 40, 41, 42]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """A 1-layer tiny model exported with --max-seq 512 (prefill chunk 16)."""
    model = tiny_model("llama2", seed=2, n_layers=1, max_seq_len=MAX_SEQ)
    out = tmp_path_factory.mktemp("rel-soak") / "export"
    export_model(model, out, ExportOptions(max_seq=MAX_SEQ, prefill_chunk=16), progress=False, log=lambda _: None)
    return out, model


def rss_mb() -> float:
    """Current (not peak) resident set size of this process."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_greedy_generation_fills_the_whole_context(soak):
    directory, model = soak
    gen = Generator.open(directory, threads=1)
    result = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(max_new_tokens=10_000))
    assert result.finish_reason == "length"
    assert len(PROMPT) + len(result.token_ids) == MAX_SEQ + 1  # the last pick needs no cache row
    assert gen.cache.length == MAX_SEQ and gen.cache.free == 0
    # every pick is PyTorch's argmax at its position, up to float noise (ties may break either way)
    fed = PROMPT + result.token_ids[:-1]  # exactly the MAX_SEQ tokens that went through the graphs
    logits = torch_logits(model, fed)[len(PROMPT) - 1:]  # row i predicts token_ids[i]
    picked = logits[np.arange(len(result.token_ids)), result.token_ids]
    assert np.all(picked >= logits.max(axis=1) - 1e-3)
    # the same generator, asked again at once: the context is reset, nothing is left over
    again = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(max_new_tokens=10_000))
    assert again.token_ids == result.token_ids


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read the RSS")
def test_twenty_back_to_back_generations_hold_memory_and_reproduce(soak):
    directory, _ = soak
    gen = Generator.open(directory, threads=1)
    stop = StopParams(max_new_tokens=10_000, seed=7)  # EOS ignored: every run goes to the full context
    first = [gen.complete(PROMPT, SAMPLED, stop, ignore_eos=True) for _ in range(2)]  # warm-up: sessions, arenas, caches
    gc.collect()
    base = rss_mb()
    peak = base
    for _ in range(20):
        result = gen.complete(PROMPT, SAMPLED, stop, ignore_eos=True)
        assert result.finish_reason == "length" and result.token_ids == first[0].token_ids
        peak = max(peak, rss_mb())
    gc.collect()
    assert first[1].token_ids == first[0].token_ids
    assert peak - base < RSS_BOUND_MB, f"RSS grew {peak - base:.1f} MB over 20 generations (from {base:.0f} MB)"
    # a seed means the same tokens in a freshly opened generator too; another seed means others
    fresh = Generator.open(directory, threads=1)
    assert fresh.complete(PROMPT, SAMPLED, stop, ignore_eos=True).token_ids == first[0].token_ids
    other = fresh.complete(PROMPT, SAMPLED, StopParams(max_new_tokens=10_000, seed=8), ignore_eos=True)
    assert other.token_ids != first[0].token_ids


# ------------------------------------------------ the CLI at the context limit (tiny export, max_seq 64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory, "llama2", "layer")[0]


def test_prompt_longer_than_the_context(capsys, tiny):
    ids = ",".join(str(i % 200 + 3) for i in range(100))  # 100 tokens, max_seq 64
    assert main(["run", str(tiny), "--prompt-ids", ids, "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt: 100 tokens do not fit the context of 64" in err and "--truncate" in err
    assert main(["run", str(tiny), "--prompt-ids", ids, "--max-new-tokens", "8", "--truncate", "--json",
                 "--temperature", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["prompt_tokens"] == 64 - 8 and doc["finish_reason"] == "max_new_tokens"
    assert len(doc["token_ids"]) == 8


@pytest.mark.parametrize("prompt_len", [40, 63, 64])
def test_context_that_fills_during_generation_ends_with_length(capsys, tiny, prompt_len):
    """max_seq 64: the last token picked needs no cache row, so prompt + new = 65 whatever the prompt."""
    ids = ",".join(str(i % 200 + 3) for i in range(prompt_len))
    assert main(["run", str(tiny), "--prompt-ids", ids, "--max-new-tokens", "500", "--json", "--seed", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["finish_reason"] == "length" and prompt_len + len(doc["token_ids"]) == 65
