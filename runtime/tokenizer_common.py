"""What every tokenizer the runtime reads shares: the `Tokenizer` protocol and small byte/error helpers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

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



def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def check_id(token_id: int, vocab_size: int, source: str) -> None:
    need(0 <= token_id < vocab_size, f"{source}: token id {token_id} is outside the vocabulary [0, {vocab_size})")



def text_bytes(text: str) -> bytes:
    """UTF-8, with surrogateescape'd raw bytes restored (other lone surrogates kept as their 3 bytes)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def join_pieces(tok: Tokenizer, ids: Sequence[int]) -> bytes:
    return b"".join(tok.piece_bytes(t, prev) for prev, t in zip([None, *ids], ids, strict=False))


def read_file(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise EdgeError(f"{path}: tokenizer file not found") from None
    except OSError as exc:
        raise EdgeError(f"{path}: cannot read tokenizer file ({exc.strerror or one_line(exc)})") from None
