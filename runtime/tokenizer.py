"""Tokenizers the board can run: Hugging Face `tokenizer.json` and llama2.c `tokenizer.bin`.

`encode` never adds BOS (the generator does). Text that came from raw bytes via
`bytes.decode("utf-8", "surrogateescape")` encodes back to exactly those bytes, so
`b"".join(tok.token_bytes(i) for i in tok.encode(text))` round-trips arbitrary bytes for the byte-exact kinds
(llama2.c byte fallback, byte-level BPE). Special tokens stand for no text: their bytes are b"".
"""


from __future__ import annotations

import codecs
import json
import lzma
import shutil
from pathlib import Path
from typing import Literal

from .errors import EdgeError, need
from .tokenizer_common import Tokenizer
from .tokenizer_hf import BYTE_TO_UNICODE, UNICODE_TO_BYTE, XZ, HFTokenizer, read_json_bytes
from .tokenizer_llama2c import Llama2cTokenizer

__all__ = ["BYTE_TO_UNICODE", "UNICODE_TO_BYTE", "HFTokenizer", "IncrementalDecoder", "Llama2cTokenizer", "Tokenizer",
           "TokenizerKind", "copy_tokenizer", "load_tokenizer", "tokenizer_kind"]

TokenizerKind = Literal["hf", "llama2c"]  # manifest `tokenizer.kind`
# its name in an export: since format 11 a tokenizer.json is shipped xz-compressed (Gemma 3's 262k-token
# tokenizer.json is 12.3 MB minified, 3.1 MB as .xz, 4.8 MB gzip'd; unpacking it takes 0.17 s of a 0.8 s load)
TOKENIZER_FILES: dict[str, str] = {"hf": "tokenizer.json" + XZ, "llama2c": "tokenizer.bin"}


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


def tokenizer_kind(path: str | Path) -> TokenizerKind:
    """The kind of a tokenizer file a user names (a flag, the file beside a checkpoint), from its format's
    suffix. An export's tokenizer is never named this way: its manifest records `tokenizer.kind`."""
    name = Path(path).name
    need(name.endswith((".json", ".json" + XZ, ".bin")),
         f"{path}: unknown tokenizer file (expected tokenizer.json, tokenizer.json.xz or tokenizer.bin)")
    return "llama2c" if name.endswith(".bin") else "hf"


def copy_tokenizer(src: str | Path, dst: str | Path, kind: TokenizerKind) -> None:
    """Write an export's tokenizer file: a tokenizer.json minified (no indentation or \\u escapes, BPE merges as
    "a b" strings, the form every `tokenizers` version reads, where no token holds a space: SmolLM2's
    pretty-printed 3.52 MB -> 1.37 MB, the same ids), xz-compressed when `dst` ends in .xz (SmolLM2: 0.43 MB);
    a tokenizer.bin as it is. `src` may be either form of a tokenizer.json."""
    if kind != "hf":
        shutil.copyfile(src, dst)
        return
    raw = read_json_bytes(Path(src))
    try:
        doc = json.loads(raw)
    except ValueError as err:
        raise EdgeError(f"{src}: not valid JSON ({err})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    merges = model.get("merges") if isinstance(model, dict) and model.get("type") == "BPE" else None
    if isinstance(merges, list) and all(isinstance(m, list) and len(m) == 2 and
                                        all(isinstance(t, str) and " " not in t for t in m) for m in merges):
        model["merges"] = [f"{a} {b}" for a, b in merges]  # [["a", "b"], ...] -> ["a b", ...]
    try:  # a lone surrogate (an escaped \ud800) has no UTF-8 form: keep the escapes then
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    Path(dst).write_bytes(lzma.compress(text, preset=9) if str(dst).endswith(XZ) else text)


def load_tokenizer(path: str | Path, vocab_size: int | None = None, *, kind: TokenizerKind | None = None,
                   bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """A Hugging Face `tokenizer.json` ("hf") or a llama2.c `tokenizer.bin` ("llama2c", needs the model's
    `vocab_size`; its BOS/EOS are fixed at 1/2, so `bos_id`/`eos_id` are for "hf" only). `kind`: the
    manifest's, or None for a file a user names (`tokenizer_kind`)."""
    path = Path(path)
    need(path.is_file(), f"{path}: tokenizer file not found")
    kind = kind if kind is not None else tokenizer_kind(path)
    if kind == "hf":
        tok = HFTokenizer.from_file(path, bos_id, eos_id)
        need(vocab_size is None or tok.vocab_size <= vocab_size,
             f"{path}: tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size {vocab_size}")
        return tok
    need(kind == "llama2c", f"{path}: unknown tokenizer kind {kind!r} (expected one of {', '.join(TOKENIZER_FILES)})")
    need(vocab_size is not None and vocab_size > 0, f"{path}: a llama2.c tokenizer.bin needs the model's vocab size (`vocab_size`)")
    return Llama2cTokenizer(path, vocab_size)
