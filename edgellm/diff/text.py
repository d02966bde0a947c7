"""The evaluation tokens: a text file through the export's tokenizer, or text the PyTorch model generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgellm.model import Decoder
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import safe_join
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.tokenizer import Tokenizer, TokenizerKind, load_tokenizer

from .collect_torch import generate_tokens


def export_tokenizer(exports: list[tuple[Path, Manifest]]) -> tuple[Path, TokenizerKind, bool] | None:
    """(tokenizer file, its kind, whether text gets BOS), as the manifest of the first export with a tokenizer
    records them."""
    for directory, manifest in exports:
        if manifest.tokenizer is not None:
            return safe_join(directory, manifest.tokenizer["file"]), manifest.tokenizer["kind"], manifest.add_bos
    return None


def file_tokens(path: Path, tokenizer: Path | None, kind: TokenizerKind | None, n_tokens: int, vocab_size: int, bos_id: int | None,
                eos_id: int | None, add_bos: bool = True) -> tuple[list[int], dict[str, Any]]:
    """The file's tokens, BOS first when `add_bos` (the checkpoint's rule, as for a prompt), cut to `n_tokens`.
    `kind`: the export's, or None for the checkpoint's file (by its name)."""
    need(tokenizer is not None, f"--text {path}: neither the exports nor the checkpoint have a tokenizer; "
                                "use --generated N instead")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as err:
        raise EdgeError(f"--text {path}: cannot read ({err.strerror})") from None
    tok = load_tokenizer(tokenizer, vocab_size, kind=kind, bos_id=bos_id, eos_id=eos_id)
    start = bos_id if add_bos and bos_id is not None else None
    ids = ([start] if start is not None else []) + tok.encode(text)
    need(len(ids) >= 2, f"--text {path}: needs at least 2 tokens, got {len(ids)}")
    ids = ids[:n_tokens]
    return ids, {"source": "file", "path": str(path), "tokenizer": str(tokenizer), "n_tokens": len(ids),
                 "start_id": start, "tokens": ids}


def generated_tokens(model: Decoder, n_new: int, seed: int, bos_id: int | None, eos_id: int | None,
                     max_seq: int) -> tuple[list[int], dict[str, Any]]:
    """[start] + `n_new` tokens sampled from the PyTorch model (temperature 1, fixed seed).

    The start token is BOS, or EOS for models without one (Qwen-style: the document separator).
    """
    start = bos_id if bos_id is not None else eos_id
    need(start is not None, "--generated: the model has neither a BOS nor an EOS token to start from; "
                            "use --text FILE")
    need(n_new >= 1, f"--generated: expected at least 1 token, got {n_new}")
    ids = generate_tokens(model, n_new, seed, start, max_seq)
    return ids, {"source": "generated", "seed": seed, "n_tokens": len(ids), "start_id": start, "tokens": ids}


def display_tokenizer(exports: list[tuple[Path, Manifest]], fallback: Path | None, vocab_size: int,
                      bos_id: int | None, eos_id: int | None) -> Tokenizer | None:
    """A tokenizer to show greedy continuations as text in the report, or None (ids only)."""
    found = export_tokenizer(exports)
    path, kind = found[:2] if found is not None else (fallback, None)
    if path is None:
        return None
    try:
        return load_tokenizer(path, vocab_size, kind=kind, bos_id=bos_id, eos_id=eos_id)
    except EdgeError:  # the report still has the ids; only --text needs a working tokenizer
        return None


def add_greedy_text(variant: dict[str, Any], tokens: list[int], tok: Tokenizer) -> None:
    """Decode each greedy prompt and both continuations into the variant's report (for readers)."""
    def text(ids: list[int]) -> str:  # padded vocabularies (Qwen): rows past the tokenizer's tokens have no text
        return tok.decode([i for i in ids if i < tok.vocab_size])

    for p in variant["greedy"]["prompts"]:
        p["prompt_text"] = text(tokens[p["start"]:p["start"] + p["prompt_len"]])
        p["reference_text"] = text(p["reference"])
        p["export_text"] = text(p["export"])
