"""Prompt rules without a model (runtime/prompts.py): truncation keeps the end and BOS, never less than half the
context; a chat feeds at least one token; token ids never load a tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.prompts import prompt_ids, shared_prefix, truncated


def test_truncation_keeps_the_last_tokens_with_room_for_the_answer() -> None:
    ids = list(range(100, 200))  # 100 ids, no BOS
    assert truncated(ids, 100, False, 10, bos_id=1) == ids  # fits: untouched
    assert truncated(ids, 64, True, 10, bos_id=1) == ids[-54:]  # 64 - 10 rows for the prompt
    assert truncated(ids, 64, True, 1000, bos_id=1) == ids[-32:]  # never less than half the context
    with pytest.raises(EdgeError, match="^prompt: 100 tokens do not fit the context of 64"):
        truncated(ids, 64, False, 10, bos_id=1)


def test_truncation_keeps_bos_in_front() -> None:
    ids = [1, *range(100, 199)]
    out = truncated(ids, 64, True, 10, bos_id=1)
    assert len(out) == 54 and out[0] == 1 and out[1:] == ids[-53:]


def test_a_chat_reuses_the_shared_prefix_but_feeds_at_least_one_token() -> None:
    cached = np.array([5, 6, 7, 8], np.int64)
    assert shared_prefix(cached, [5, 6, 9, 8, 10]) == 2   # differs at row 2
    assert shared_prefix(cached, [5, 6, 7, 8, 10]) == 4   # all cached rows kept, the new token fed
    assert shared_prefix(cached, [5, 6, 7, 8]) == 3       # the same conversation: its last token is fed again
    assert shared_prefix(cached[:0], [5, 6]) == 0


def test_token_ids_are_checked_and_never_load_the_tokenizer() -> None:
    def no_tokenizer():
        raise AssertionError("token ids must not load a tokenizer")

    assert prompt_ids(np.array([3, 4]), no_tokenizer, [1], 10, "exp") == [3, 4]  # no BOS added to ids
    with pytest.raises(EdgeError, match=r"^prompt_ids: token ids must be in \[0, 10\), got \[10, -1\]"):
        prompt_ids([10, -1], no_tokenizer, [], 10, "exp")
    with pytest.raises(EdgeError, match="^prompt: exp has no tokenizer"):
        prompt_ids("hello", lambda: None, [], 10, "exp")
