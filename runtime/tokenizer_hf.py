"""Hugging Face `tokenizer.json` through the `tokenizers` library; byte-level models stream bytes exactly."""

from __future__ import annotations

import json
import lzma
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import EdgeError, need
from .tokenizer_common import check_id, join_pieces, one_line, read_file

if TYPE_CHECKING:  # imported where a tokenizer is loaded: ids-only runs never hold the library (~9 MB RSS)
    import tokenizers

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
        from tokenizers.decoders import ByteLevel

        self.byte_exact = isinstance(tok.decoder, ByteLevel)

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

    def encode_template(self, text: str) -> list[int]:
        """A rendered chat template: its special tokens (<|im_start|>, ...) are control tokens, not text."""
        self.tok.encode_special_tokens = False
        try:
            return self.encode(text)
        finally:
            self.tok.encode_special_tokens = True

    def token_text(self, token_id: int | None) -> str | None:
        """A token's vocabulary entry ("<s>", "<|im_end|>"), as a chat template refers to it."""
        return self.tok.id_to_token(token_id) if token_id is not None else None

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
        check_id(token_id, self.vocab_size, self.source)
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
            return join_pieces(self, ids).decode("utf-8", "replace")
        for token_id in ids:
            check_id(token_id, self.vocab_size, self.source)
        return self.tok.decode(list(ids), skip_special_tokens=True)


XZ = ".xz"  # an xz-compressed tokenizer.json (what exports ship since format 11)


def read_json_bytes(path: Path) -> bytes:
    """A tokenizer.json's bytes, unpacked when the file is a tokenizer.json.xz."""
    raw = read_file(path)
    if not path.name.endswith(XZ):
        return raw
    try:
        return lzma.decompress(raw, format=lzma.FORMAT_XZ)
    except lzma.LZMAError as exc:
        raise EdgeError(f"{path}: corrupt tokenizer.json.xz, not xz data ({one_line(exc)})") from None


def _read_hf(path: Path) -> tokenizers.Tokenizer:
    """The tokenizer, parsed once, by the Rust side (which rejects a version other than "1.0" and a missing
    model itself). Only a file it refuses is parsed again, in Python, to say what is wrong with it: parsing
    every file into Python objects first, to check two keys, cost more peak memory than the tokenizer itself
    (Qwen2.5's 151k-token tokenizer.json: +70 MB peak RSS for the load, +47 MB without it)."""
    import tokenizers

    raw = read_json_bytes(path)
    try:
        return tokenizers.Tokenizer.from_buffer(raw)
    except BaseException as exc:  # the Rust side raises Exception, or pyo3's PanicException (a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failure = one_line(exc)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EdgeError(f"{path}: corrupt tokenizer.json, not UTF-8 JSON ({one_line(exc)})") from None
    need(isinstance(data, dict) and "model" in data, f"{path}: not a tokenizer.json (no 'model' section)")
    need(data.get("version") == "1.0",
         f"{path}: tokenizer.json version {data.get('version')!r} is not supported (expected '1.0')")
    raise EdgeError(f"{path}: corrupt tokenizer.json ({failure})")


# ---------------------------------------------------------------------------------------------------------
