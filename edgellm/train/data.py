"""Training data: sources tokenized once into a memmapped token file, a held-out tail, random windows.

Token file (format `edgellm-tokens`, version 1): `tokens.bin` holds the raw ids (uint16 when the vocabulary
fits, else uint32, native little-endian), `tokens.json` beside it says how to read them (dtype, count,
vocab size, the tokenizer's sha256, the sources' sha256). The json is written last, so a token file with
its json is complete; a later run with the same sources and tokenizer reuses it instead of re-tokenizing.

Sources are text files (split into documents at blank lines; each document becomes BOS ids EOS) or
pre-tokenized `.npy` / `.bin` arrays (a `.bin` without a `tokens.json`-style sidecar is read as uint16 when
vocab_size < 65536, else uint32, as llama2.c writes them).

Windows: offsets i are drawn uniformly, x = t[i:i+T], y = t[i+1:i+T+1] (seed 003's get_batch). One seeded
numpy Generator draws the offsets of the whole global batch; data-parallel rank r keeps its slice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.tokenizer import HFTokenizer, Tokenizer

FORMAT = "edgellm-tokens"
FORMAT_VERSION = 1
_DOC_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")  # a blank line ends a document
_BATCH_DOCS = 2048  # documents per encode call: bounds memory, keeps the Rust tokenizer busy
_BLOCK_CHARS = 1 << 23  # text read per block


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenFile:
    path: Path  # tokens.bin
    tokens: np.ndarray  # [N] uint16 | uint32, a read-only memmap
    vocab_size: int
    meta: dict[str, Any]

    def split(self, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(train, val): the last `val_fraction` of the tokens is held out; both must fit one window."""
        n = len(self.tokens)
        n_val = math.ceil(n * val_fraction)
        need(0.0 < val_fraction < 1.0, f"val_fraction must be in (0, 1), got {val_fraction}")
        need(n_val >= seq_len + 1 and n - n_val >= seq_len + 1,
             f"{self.path}: {n} tokens are too few for --seq-len {seq_len} with {val_fraction:.0%} held out "
             f"(each split needs at least {seq_len + 1}); give more data or a shorter --seq-len")
        return self.tokens[: n - n_val], self.tokens[n - n_val :]


def open_token_file(path: Path) -> TokenFile:
    """Open `tokens.bin` through its `tokens.json`; reject other formats and versions."""
    path = Path(path)
    meta_path = path.with_suffix(".json")
    need(meta_path.is_file(), f"{meta_path}: token file header not found")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgeError(f"{meta_path}: unreadable token file header ({exc})") from None
    need(meta.get("format") == FORMAT, f"{meta_path}: not an {FORMAT} header")
    need(meta.get("format_version") == FORMAT_VERSION,
         f"{meta_path}: format_version {meta.get('format_version')!r} is not supported (expected {FORMAT_VERSION})")
    dtype = np.dtype(meta["dtype"])
    n = int(meta["n_tokens"])
    need(path.is_file() and path.stat().st_size == n * dtype.itemsize,
         f"{path}: expected {n} {dtype} tokens ({n * dtype.itemsize} bytes) as {meta_path} says")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    return TokenFile(path, tokens, int(meta["vocab_size"]), meta)


def build_token_file(sources: list[Path], out: Path, vocab_size: int, tokenizer: Tokenizer | None = None,
                     tokenizer_sha256: str | None = None) -> TokenFile:
    """Tokenize `sources` into `out` (tokens.bin + tokens.json), or reuse `out` if it holds exactly them."""
    out = Path(out)
    described = [_describe(Path(s)) for s in sources]
    need(len(described) > 0, "--data: no data files given")
    if out.is_file() and out.with_suffix(".json").is_file():
        cached = open_token_file(out)
        same = [(s["sha256"], s["kind"]) for s in cached.meta["sources"]] == [(s["sha256"], s["kind"]) for s in described]
        if same and cached.vocab_size == vocab_size and cached.meta.get("tokenizer_sha256") == tokenizer_sha256:
            return cached
    dtype = token_dtype(vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").unlink(missing_ok=True)  # the old header no longer describes tokens.bin
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as fh:
        for src in described:
            src["n_tokens"] = 0
            for ids in _source_ids(Path(src["file"]), src["kind"], vocab_size, tokenizer):
                need(ids.size == 0 or int(ids.max()) < vocab_size,
                     f"{src['file']}: token id {int(ids.max()) if ids.size else 0} >= vocab_size {vocab_size}")
                fh.write(ids.astype(dtype).tobytes())
                src["n_tokens"] += int(ids.size)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
        "n_tokens": sum(s["n_tokens"] for s in described), "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
        "bos_id": getattr(tokenizer, "bos_id", None), "eos_id": getattr(tokenizer, "eos_id", None),
        "sources": described,
    }
    meta_tmp = out.with_name(out.stem + ".json.tmp")
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, out.with_suffix(".json"))
    return open_token_file(out)


def _describe(path: Path) -> dict[str, Any]:
    need(path.is_file(), f"--data {path}: file not found")
    kind = "tokens" if path.suffix in (".npy", ".bin") else "text"
    return {"file": str(path), "kind": kind, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _source_ids(path: Path, kind: str, vocab_size: int, tokenizer: Tokenizer | None) -> Iterator[np.ndarray]:
    """Yield int64 id arrays for one source, a bounded chunk at a time."""
    if kind == "tokens":
        yield np.asarray(_read_token_array(path, vocab_size), dtype=np.int64)
        return
    need(tokenizer is not None, f"--data {path}: a text file needs a tokenizer (--tokenizer or --vocab-size)")
    for docs in _documents(path):
        for start in range(0, len(docs), _BATCH_DOCS):
            chunk = docs[start : start + _BATCH_DOCS]
            if isinstance(tokenizer, HFTokenizer):  # the Rust batch encoder: the same ids as tokenizer.encode
                encoded = [e.ids for e in tokenizer.tok.encode_batch(chunk, add_special_tokens=False)]
            else:
                encoded = [tokenizer.encode(d) for d in chunk]
            flat: list[int] = []
            for ids in encoded:
                flat.append(tokenizer.bos_id)
                flat.extend(ids)
                flat.append(tokenizer.eos_id)
            yield np.asarray(flat, dtype=np.int64)


def _documents(path: Path) -> Iterator[list[str]]:
    """The documents of a text file, a block of the file at a time (constant memory for big corpora)."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            tail = ""
            while block := fh.read(_BLOCK_CHARS):
                parts = _DOC_BREAK.split(tail + block)
                tail = parts.pop()  # the last document may go on in the next block
                yield [d.strip() for d in parts if d.strip()]
            if tail.strip():
                yield [tail.strip()]
    except UnicodeDecodeError:
        raise EdgeError(f"--data {path}: not UTF-8 text; pass pre-tokenized .npy/.bin files instead") from None


def _read_token_array(path: Path, vocab_size: int) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise EdgeError(f"--data {path}: not a readable .npy array ({exc})") from None
        need(arr.ndim == 1 and arr.dtype.kind in "iu", f"--data {path}: expected a 1-D integer array, got "
             f"{arr.ndim}-D {arr.dtype}")
        return arr
    sidecar = path.with_suffix(".json")
    if sidecar.is_file():
        return open_token_file(path).tokens
    dtype = token_dtype(vocab_size)
    need(path.stat().st_size % dtype.itemsize == 0,
         f"--data {path}: {path.stat().st_size} bytes is not a whole number of {dtype} tokens")
    return np.memmap(path, dtype=dtype, mode="r")


class WindowSampler:
    """Random training windows from one seeded stream; its state is part of a checkpoint.

    Every rank holds the same stream and draws the offsets of the whole global batch (world * B), then keeps
    rows [rank*B, (rank+1)*B): N ranks with batch B see exactly the windows one rank with batch N*B sees.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        need(len(tokens) >= seq_len + 1, f"need at least {seq_len + 1} training tokens, got {len(tokens)}")
        self.tokens, self.seq_len = tokens, seq_len
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def draw(self, global_batch: int, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) int64 [B, T] for this rank, B = global_batch // world."""
        offsets = self.rng.integers(0, len(self.tokens) - self.seq_len, size=global_batch)
        per_rank = global_batch // world
        return windows(self.tokens, offsets[rank * per_rank : (rank + 1) * per_rank], self.seq_len)

    def state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """offsets [n] -> x = t[i:i+T], y = t[i+1:i+T+1], both int64 [n, T]."""
    rows = np.asarray(tokens[offsets[:, None] + np.arange(seq_len + 1)], dtype=np.int64)  # [n, T+1]
    return rows[:, :-1], rows[:, 1:]


def eval_offsets(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """n_windows fixed offsets spread evenly over the held-out tokens: every evaluation scores the same text."""
    last = n_tokens - seq_len - 1
    return np.unique(np.linspace(0, last, n_windows).round().astype(np.int64))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the tokens' own unigram distribution: the loss of the best context-free guess."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
