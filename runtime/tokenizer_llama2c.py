"""llama2.c `tokenizer.bin`: int32 max_token_length, then per token: float32 score, int32 len, len bytes.

Encoding follows run.c: UTF-8 code points (unknown ones as <0xXX> byte pieces), then greedy merges of the
best-scoring adjacent pair.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from .errors import need
from .tokenizer_common import check_id, join_pieces, read_file, text_bytes

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{1,2})")  # what run.c's sscanf("<0x%02hhX>") accepts
_NO_MERGE = -1e10  # run.c's initial best_score: merges scoring at or below it never happen


class Llama2cTokenizer:
    """run.c's BPE: codepoints (else `<0xNN>` byte pieces), then merge the best-scoring adjacent pair."""

    byte_exact = True
    bos_id = 1
    eos_id = 2
    pad_id = None

    def __init__(self, path: Path, vocab_size: int) -> None:
        self.source = str(path)
        self.vocab_size = vocab_size
        self.scores, self.pieces = _read_llama2c(path, vocab_size)
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            self._ids.setdefault(piece, i)  # duplicates: the first id wins (run.c's bsearch picks any)

    def encode(self, text: str) -> list[int]:
        data = text_bytes(text)
        if not data:
            return []
        # run.c's add_dummy_prefix: a " " token first (its byte piece if " " is not in the vocab)
        ids = [self._ids.get(b" ", 0x20 + 3)]
        for group in _codepoints(data):
            found = self._ids.get(group)
            ids.extend([found] if found is not None else [b + 3 for b in group])  # <0xNN> = byte + 3
        return self._merge(ids)

    def _merge(self, ids: list[int]) -> list[int]:
        """run.c's loop (merge the highest-scoring pair, leftmost on ties, until none is in the vocab) with a
        heap and a linked list: O(n log n) instead of O(n^2). The position key keeps run.c's tie order."""
        n = len(ids)
        tok, nxt, prv, alive = list(ids), list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        heap: list[tuple[float, int, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j < n:
                merged = self._ids.get(self.pieces[tok[i]] + self.pieces[tok[j]])
                if merged is not None and self.scores[merged] > _NO_MERGE:
                    heapq.heappush(heap, (-self.scores[merged], i, tok[i], tok[j], merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, left, right, merged = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j >= n or tok[i] != left or tok[j] != right:
                continue  # stale: one side was merged away since this pair was pushed
            tok[i], alive[j], nxt[i] = merged, False, nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [t for t, live in zip(tok, alive, strict=True) if live]

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes(token_id, after_bos=False)

    def piece_bytes(self, token_id: int, prev_id: int | None) -> bytes:
        # run.c: after BOS the sentencepiece decoder drops the leading space; the start of text counts as BOS
        return self._bytes(token_id, after_bos=prev_id in (None, self.bos_id))

    def _bytes(self, token_id: int, after_bos: bool) -> bytes:
        check_id(token_id, self.vocab_size, self.source)
        if token_id < 3:
            return b""  # <unk>, <s>, </s>
        piece = self.pieces[token_id]
        if after_bos and piece.startswith(b" "):
            piece = piece[1:]
        match = _BYTE_PIECE.match(piece)
        return bytes([int(match.group(1), 16)]) if match else piece

    def decode(self, ids: Sequence[int]) -> str:
        return join_pieces(self, ids).decode("utf-8", "replace")


def _read_llama2c(path: Path, vocab_size: int) -> tuple[list[float], list[bytes]]:
    data = read_file(path)
    need(len(data) >= 4, f"{path}: truncated tokenizer.bin ({len(data)} bytes, no header)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    need(max_len > 0, f"{path}: corrupt tokenizer.bin header (max_token_length {max_len})")
    scores: list[float] = []
    pieces: list[bytes] = []
    pos = 4
    for i in range(vocab_size):
        need(pos + 8 <= len(data), f"{path}: truncated tokenizer.bin: ends at token {i} of vocab_size {vocab_size}")
        score, size = struct.unpack_from("<fi", data, pos)
        pos += 8
        need(0 < size <= max_len, f"{path}: corrupt tokenizer.bin: token {i} has length {size} (max {max_len})")
        need(pos + size <= len(data), f"{path}: truncated tokenizer.bin: token {i} of vocab_size {vocab_size}")
        scores.append(score)
        pieces.append(data[pos : pos + size].split(b"\0", 1)[0])  # run.c sees C strings
        pos += size
    need(pos == len(data), f"{path}: {len(data) - pos} bytes left after {vocab_size} tokens: the tokenizer.bin "
         "holds more tokens than the model's vocab_size")
    need(vocab_size >= 259 and all(pieces[3 + b] == b"<0x%02X>" % b for b in range(256)),
         f"{path}: tokenizer.bin must hold the byte pieces <0x00>..<0xFF> at ids 3..258 (byte fallback)")
    return scores, pieces


def _codepoints(data: bytes) -> list[bytes]:
    """Split UTF-8 bytes the way run.c does: a lead byte plus its continuation bytes, at most 4 at a time."""
    groups: list[bytes] = []
    start = 0
    for i in range(len(data)):
        nxt = data[i + 1] if i + 1 < len(data) else 0
        if (nxt & 0xC0) == 0x80 and i + 1 - start < 4:
            continue
        groups.append(data[start : i + 1])
        start = i + 1
    return groups


# ---------------------------------------------------------------------------------------------------------
