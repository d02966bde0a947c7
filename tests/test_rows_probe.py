"""`rows_exact_here`: the measured half of `--speculative auto`'s greedy rule (a few decode steps against one
verification of the same tokens, on this machine's kernels), which must leave the generator as it found it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig
from edgellm.runtime.speculative import rows_exact_here
from tests.quant_helpers import export as tiny_export

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 256, 12)]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("probe"), "qwen2", "layer")[1]


def test_the_probe_finds_exact_rows_here_and_leaves_no_trace(export: Path) -> None:
    fresh = Generator.open(export, config=SessionConfig(exact=True)).complete(PROMPT, SamplingParams(temperature=0), StopParams(16), ignore_eos=True,
                                            text=False).token_ids
    gen = Generator.open(export, config=SessionConfig(exact=True))   # the spare-row stack
    gen.complete(PROMPT[:5], SamplingParams(temperature=0), StopParams(3), ignore_eos=True, text=False)
    before = (gen.cache.length, [k.copy() for k in gen.cache.keys])
    assert rows_exact_here(gen.engine) == (True, 0.0)  # x86: the spare-row stack's rows are exact
    assert gen.cache.length == before[0]
    for k, k0 in zip(gen.cache.keys, before[1], strict=True):
        assert np.array_equal(k[:, :, :before[0]], k0[:, :, :before[0]])  # the filled rows untouched
    again = gen.complete(PROMPT, SamplingParams(temperature=0), StopParams(16), ignore_eos=True, text=False)
    assert again.token_ids == fresh


def test_the_probe_refuses_what_is_not_built_exact(export: Path) -> None:
    lone = Generator.open(export, config=SessionConfig(exact=False))  # fp32 cache: the lone row differs
    assert not lone.engine.exact_rows
    assert rows_exact_here(lone.engine) == (False, float("inf"))
