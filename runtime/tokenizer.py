"""Tokenizers the board can run: Hugging Face `tokenizer.json` and llama2.c `tokenizer.bin`.

`encode` never adds BOS (the generator does). Text that came from raw bytes via
`bytes.decode("utf-8", "surrogateescape")` encodes back to exactly those bytes, so
`b"".join(tok.token_bytes(i) for i in tok.encode(text))` round-trips arbitrary bytes for the byte-exact kinds
(llama2.c byte fallback, byte-level BPE). Special tokens stand for no text: their bytes are b"".
"""

from __future__ import annotations

import codecs
import heapq
import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

from .errors import EdgeError, need


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int | None
    # True when the text's UTF-8 bytes are exactly the concatenated `piece_bytes`, so streaming can work on
    # bytes; False for HF decoders that rewrite text (Metaspace, Strip...): streaming decodes prefixes instead.
    byte_exact: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for, out of context."""
        ...

    def piece_bytes(self, token_id: int, prev_id: int | None) -> bytes:
        """The bytes `token_id` adds to the text after `prev_id` (None: it starts the text)."""
        ...


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_id(token_id: int, vocab_size: int, source: str) -> None:
    need(0 <= token_id < vocab_size, f"{source}: token id {token_id} is outside the vocabulary [0, {vocab_size})")


# ---------------------------------------------------------------------------------------------------------
# llama2.c tokenizer.bin: int32 max_token_length, then per token: float32 score, int32 len, len bytes.

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
        data = _text_bytes(text)
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
        _check_id(token_id, self.vocab_size, self.source)
        if token_id < 3:
            return b""  # <unk>, <s>, </s>
        piece = self.pieces[token_id]
        if after_bos and piece.startswith(b" "):
            piece = piece[1:]
        match = _BYTE_PIECE.match(piece)
        return bytes([int(match.group(1), 16)]) if match else piece

    def decode(self, ids: Sequence[int]) -> str:
        return _join_pieces(self, ids).decode("utf-8", "replace")


def _read_llama2c(path: Path, vocab_size: int) -> tuple[list[float], list[bytes]]:
    data = _read(path)
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
# Hugging Face tokenizer.json

_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
_ESCAPED_BYTE = re.compile("([\udc80-\udcff])")  # a raw byte carried by surrogateescape


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level table: printable bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + extra)
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


class HFTokenizer:
    """A `tokenizers.Tokenizer`; byte-level models decode through the byte table so bytes stream exactly."""

    def __init__(self, tok: tokenizers.Tokenizer, source: str, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None) -> None:
        self.tok, self.source = tok, source
        tok.encode_special_tokens = True  # "<eos>" typed in a prompt is text, not a control token
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id if bos_id is not None else self._find(_BOS_NAMES, "BOS", "bos_id")
        self.eos_id = eos_id if eos_id is not None else self._find(_EOS_NAMES, "EOS", "eos_id")
        self.pad_id = pad_id if pad_id is not None else next(
            (i for i in map(tok.token_to_id, _PAD_NAMES) if i is not None), None)
        added = tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items() if not t.special}
        specials = {self.bos_id, self.eos_id, self.pad_id} - {None}
        self._special = {i for i, t in added.items() if t.special} | specials
        self.byte_exact = isinstance(tok.decoder, tokenizers.decoders.ByteLevel)

    @classmethod
    def from_file(cls, path: Path, bos_id: int | None = None, eos_id: int | None = None) -> HFTokenizer:
        return cls(_read_hf(path), str(path), bos_id, eos_id)

    def _find(self, names: tuple[str, ...], what: str, flag: str) -> int:
        found = next((i for i in map(self.tok.token_to_id, names) if i is not None), None)
        need(found is not None, f"{self.source}: no {what} token (looked for {', '.join(names)}); pass {flag}")
        return found

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # raw bytes smuggled in as surrogates: see _encode_escaped
            return self._encode_escaped(text)
        return self.tok.encode(text, add_special_tokens=False).ids

    def _encode_escaped(self, text: str) -> list[int]:
        """Valid runs go through the tokenizer, each escaped byte becomes its byte-level token."""
        ids: list[int] = []
        for i, part in enumerate(_ESCAPED_BYTE.split(text)):
            if i % 2 == 0:
                part = re.sub("[\ud800-\udfff]", "\ufffd", part)  # lone surrogates no byte stands for
                ids.extend(self.tok.encode(part, add_special_tokens=False).ids if part else [])
                continue
            byte_id = self.tok.token_to_id(BYTE_TO_UNICODE[ord(part) - 0xDC00]) if self.byte_exact else None
            ids.extend([byte_id] if byte_id is not None else self.encode("\ufffd"))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        _check_id(token_id, self.vocab_size, self.source)
        if token_id in self._special:
            return b""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")  # added tokens are stored as plain text
        piece = self.tok.id_to_token(token_id)
        need(piece is not None, f"{self.source}: token id {token_id} has no entry in the vocabulary")
        if self.byte_exact and all(c in UNICODE_TO_BYTE for c in piece):
            return bytes(UNICODE_TO_BYTE[c] for c in piece)
        return self.tok.decode([token_id], skip_special_tokens=True).encode("utf-8", "surrogatepass")

    def piece_bytes(self, token_id: int, prev_id: int | None) -> bytes:
        return self.token_bytes(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        if self.byte_exact:
            return _join_pieces(self, ids).decode("utf-8", "replace")
        for token_id in ids:
            _check_id(token_id, self.vocab_size, self.source)
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _read_hf(path: Path) -> tokenizers.Tokenizer:
    raw = _read(path)
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EdgeError(f"{path}: corrupt tokenizer.json, not UTF-8 JSON ({_one_line(exc)})") from None
    need(isinstance(data, dict) and "model" in data, f"{path}: not a tokenizer.json (no 'model' section)")
    need(data.get("version") == "1.0",
         f"{path}: tokenizer.json version {data.get('version')!r} is not supported (expected '1.0')")
    try:
        return tokenizers.Tokenizer.from_str(text)
    except BaseException as exc:  # the Rust side raises Exception, or pyo3's PanicException (a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise EdgeError(f"{path}: corrupt tokenizer.json ({_one_line(exc)})") from None


# ---------------------------------------------------------------------------------------------------------


def _text_bytes(text: str) -> bytes:
    """UTF-8, with surrogateescape'd raw bytes restored (other lone surrogates kept as their 3 bytes)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _join_pieces(tok: Tokenizer, ids: Sequence[int]) -> bytes:
    return b"".join(tok.piece_bytes(t, prev) for prev, t in zip([None, *ids], ids, strict=False))


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise EdgeError(f"{path}: tokenizer file not found") from None
    except OSError as exc:
        raise EdgeError(f"{path}: cannot read tokenizer file ({exc.strerror or _one_line(exc)})") from None


class IncrementalDecoder:
    """Streams text token by token; `push` returns only whole characters, `flush` the held-back rest.

    The outputs concatenate to `tokenizer.decode(ids)`. Byte-exact tokenizers feed their bytes to an
    incremental UTF-8 decoder (it holds an incomplete sequence back). The others decode a sliding window of
    ids twice (with and without the new ones) and emit the difference once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._prev: int | None = None
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and no longer decoded
        self._read = 0  # ids[:_read] are emitted

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok.byte_exact:
            text = self._utf8.decode(tok.piece_bytes(token_id, self._prev))
            self._prev = token_id
            return text
        self._ids.append(token_id)
        before, after = self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete byte sequence at the end
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        if self.tokenizer.byte_exact:
            return self._utf8.decode(b"", final=True)
        before, after = self._window()
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the ids not emitted yet."""
        window = self._ids[self._prefix :]
        return self.tokenizer.decode(window[: self._read - self._prefix]), self.tokenizer.decode(window)


def load_tokenizer(path: str | Path, vocab_size: int | None = None, *, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer:
    """`tokenizer.json` (HF) or `tokenizer.bin` (llama2.c, needs the model's `vocab_size`), by file name."""
    path = Path(path)
    need(path.is_file(), f"{path}: tokenizer file not found")
    if path.suffix == ".json":
        tok = HFTokenizer.from_file(path, bos_id, eos_id)
        need(vocab_size is None or tok.vocab_size <= vocab_size,
             f"{path}: tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size {vocab_size}")
        return tok
    need(path.suffix == ".bin", f"{path}: unknown tokenizer file (expected tokenizer.json or tokenizer.bin)")
    need(vocab_size is not None and vocab_size > 0, f"{path}: a llama2.c tokenizer.bin needs the model's vocab size (--vocab-size)")
    need(bos_id in (None, 1) and eos_id in (None, 2), f"{path}: llama2.c tokenizers use BOS=1 and EOS=2")
    return Llama2cTokenizer(path, vocab_size)
