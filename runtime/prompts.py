"""Prompts to token ids: what the Generator feeds.

Text is tokenized and, when the context starts empty, BOS (the manifest's `bos_id`) is put in front if the
checkpoint's tokenizer puts one there (manifest `tokenizer.add_bos`, export/bos_rule.py: Llama yes, Qwen no), so
the ids are `transformers`' `tokenizer(text).input_ids`; a list of token ids is used exactly as given (no BOS
added) and needs no tokenizer. A prompt longer than the context is an error unless `truncate=True`, which keeps the
last `max_seq - min(max_new_tokens, max_seq // 2)` tokens (room for the answer, but never less than half the
context) and, if the prompt began with BOS, keeps that BOS in front. A chat reuses the cached rows it shares with
the rendered conversation (`shared_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .errors import need
from .tokenizer import Tokenizer


def prompt_ids(prompt: str | Sequence[int], tokenizer: Callable[[], Tokenizer | None], bos: Sequence[int],
               vocab_size: int, where: str) -> list[int]:
    """Token ids for a prompt: text through `tokenizer()` (called only for text: it may load one) with `bos` in
    front; ids checked against the vocabulary and used as given. `where`: the export, for the errors."""
    if isinstance(prompt, str):
        need(prompt != "", "prompt: expected a non-empty prompt")
        tok = tokenizer()
        need(tok is not None, f"prompt: {where} has no tokenizer; pass token ids (`prompt_ids`)")
        ids = [*bos, *tok.encode(prompt)]
        need(len(ids) > 0, "prompt: the prompt encodes to no tokens")
        return ids
    ids = [int(i) for i in prompt]
    need(len(ids) > 0, "prompt_ids: expected at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    need(not bad, f"prompt_ids: token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return ids


def truncated(ids: list[int], limit: int, truncate: bool, max_new: int, bos_id: int | None) -> list[int]:
    """`ids` if they fit `limit` rows; else, with `truncate`, their last `limit - min(max_new, limit // 2)` (BOS
    kept in front), or an error."""
    if len(ids) <= limit:
        return ids
    need(truncate, f"prompt: {len(ids)} tokens do not fit the context of {limit} (max_seq of the "
                   "export); shorten it or pass `truncate` to keep its last tokens")
    keep = limit - min(max_new, limit // 2)
    if bos_id is not None and ids[0] == bos_id:
        return [ids[0]] + ids[len(ids) - keep + 1:]
    return ids[len(ids) - keep:]


def shared_prefix(cached: np.ndarray, ids: Sequence[int]) -> int:
    """How many leading `ids` the cached rows' ids already hold, leaving at least one id to feed (its logits pick
    the first new token)."""
    n = min(len(ids) - 1, len(cached))
    same = np.flatnonzero(cached[:n] != np.asarray(ids[:n], np.int64))
    return int(same[0]) if len(same) else n
