"""runtime/columns.py: a head's logits in another column order (manifest format 12's `logit_columns`) pick and
read back exactly as the same logits in vocabulary order do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgellm.runtime.columns import MAX_RUNS, Columns
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.sampling import argmax_checked


def split_columns(v: int, rng: np.random.Generator) -> np.ndarray:
    """What a head split by rows computes: some ids ascending, then the others ascending."""
    hi = rng.random(v) < 0.3
    return np.concatenate([np.flatnonzero(hi), np.flatnonzero(~hi)])


@pytest.mark.parametrize("runs", ["split", "many"])
def test_token_is_the_vocabulary_argmax_ties_to_the_lower_id(runs: str) -> None:
    rng = np.random.default_rng(0)
    v = 300
    for trial in range(200):
        ids = split_columns(v, rng) if runs == "split" else rng.permutation(v)
        cols = Columns(ids)
        assert (len(cols.runs) == 2) if runs == "split" else (len(cols.runs) > MAX_RUNS)
        vocab = rng.integers(-3, 4, v).astype(np.float32)     # few values: ties everywhere, across the runs
        if trial % 3 == 0:
            vocab[rng.integers(0, v, 20)] = -np.inf
        raw = np.empty(v, np.float32)
        raw[np.argsort(ids)] = vocab[np.sort(ids)]             # column j holds token ids[j]'s logit
        assert np.array_equal(raw, vocab[ids])
        assert cols.token(raw) == argmax_checked(vocab) == int(np.flatnonzero(vocab == vocab.max())[0])
        assert np.array_equal(cols.vocab(raw), vocab)
        assert np.array_equal(cols.vocab(np.stack([raw, raw[::-1]]))[0], vocab)   # any leading axes


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_picks_are_rejected_as_argmax_checked_rejects_them(bad: float) -> None:
    ids = split_columns(50, np.random.default_rng(1))
    raw = np.zeros(50, np.float32)
    raw[7] = bad
    for cols, x in ((Columns(ids), raw), (Columns(None), raw)):
        with pytest.raises(EdgeError, match="logits must be finite"):
            cols.token(x)
    with pytest.raises(EdgeError, match="logits must be finite"):
        Columns(ids).token(np.full(50, -np.inf, np.float32))


def test_identity_returns_its_input() -> None:
    x = np.arange(6, dtype=np.float32)
    cols = Columns.read(None, 6)
    assert cols.identity and cols.vocab(x) is x and cols.token(x) == 5


def test_read_checks_size_and_permutation(tmp_path: Path) -> None:
    f = tmp_path / "logit_columns.i32"
    ids = split_columns(40, np.random.default_rng(2))
    f.write_bytes(ids.astype("<i4").tobytes())
    assert np.array_equal(Columns.read(f, 40).ids, ids)
    with pytest.raises(EdgeError, match=r"logit_columns.i32: expected 41 int32 token ids \(164 bytes\), got 160"):
        Columns.read(f, 41)
    f.write_bytes(np.r_[ids[:-1], ids[0]].astype("<i4").tobytes())
    with pytest.raises(EdgeError, match="logit_columns.i32: logit_columns: expected every token id exactly once"):
        Columns.read(f, 40)
    f.write_bytes(np.r_[ids[:-1], 40].astype("<i4").tobytes())
    with pytest.raises(EdgeError, match=r"ids must lie in 0..39"):
        Columns.read(f, 40)
