"""The tokenizer a GGUF describes in its metadata, rebuilt with the `tokenizers` library as transformers'
GGUF conversion builds it (transformers/integrations/gguf/gguf_tokenizer_mapping.py), and written as a
`tokenizer.json` + `tokenizer_config.json` pair, so everything downstream treats it like an HF directory.

`tokenizer.ggml.model`:
  "gpt2"  byte-level BPE: `tokens` (respelled into the byte alphabet when they are not), `merges`, a
          ByteLevel pre-tokenizer, or the split regex of the `pre` name when transformers knows it.
  "llama" SentencePiece BPE: `tokens` as the file spells them, merges from the file or derived from
          `scores` (transformers' generate_merges), byte fallback, Metaspace with prepend_scheme "first", or
          "never" when `tokenizer.ggml.add_space_prefix` is false (Gemma: "The" at the start is `The`, not
          `▁The`). Gemma files (general.architecture gemma*) list no merges and their scores do not follow the
          merge order: merges are ranked by file position and all-space tokens respelled with `▁`, as
          transformers' gemma_tokenizer does.
Control tokens (token_type 3) become special added tokens, user-defined ones (4) plain added tokens.

The BOS rule travels both ways a reader may look: the post-processor adds BOS exactly when
`tokenizer_config.json`'s `add_bos_token` says so (`tokenizer.ggml.add_bos_token`; when absent, true for
"llama" vocabularies, as llama.cpp and transformers do, false otherwise).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.tokenizer_hf import BYTE_TO_UNICODE

from .gguf_file import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# `tokenizer.ggml.pre` -> the split regex transformers uses for it (others keep GPT-2's ByteLevel regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def _merges(meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    if meta.get("merges") is not None:
        return [tuple(m.split(" ")) for m in meta["merges"]]  # type: ignore[misc]
    scores = meta.get("scores")
    need(scores is not None, f"{meta['path']}: a llama vocabulary needs tokenizer.ggml.merges or .scores")
    return generate_merges(vocab, dict(zip(meta["tokens"], scores, strict=True)))


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of every scored token into two vocabulary pieces, best score first (transformers'
    `generate_merges` with vocab_scores, tie-broken the same way)."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    alphabet = BYTE_TO_UNICODE
    letters = set(alphabet.values())
    vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(meta["tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = PRE_SPLITS.get(meta.get("pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


GEMMA = ("gemma", "gemma2", "gemma3")


def _sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    if meta["arch"] in GEMMA:  # a run of spaces is stored as spaces but looked up as ▁s; merges in file order
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in meta["tokens"]]
        meta = {**meta, "tokens": tokens, "merges": None, "scores": [-float(i) for i in range(len(tokens))]}
    vocab = {t: i for i, t in enumerate(meta["tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True, byte_fallback=True,
                               dropout=None))
    prefix = meta["space_prefix"]
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def _metadata(g: GGUFFile) -> dict[str, Any]:
    kind = g.require("tokenizer.ggml.model")
    need(kind in BUILDERS, f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (supported: "
         f"{', '.join(BUILDERS)})")
    tokens = g.require("tokenizer.ggml.tokens")
    need(isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens),
         f"{g.path}: tokenizer.ggml.tokens must be a non-empty list of strings")
    meta = {"path": g.path, "model": kind, "tokens": tokens, "pre": g.get("tokenizer.ggml.pre"),
            "merges": g.get("tokenizer.ggml.merges"), "scores": g.get("tokenizer.ggml.scores"),
            "token_type": g.get("tokenizer.ggml.token_type") or [], "arch": g.get("general.architecture"),
            "space_prefix": bool(g.get("tokenizer.ggml.add_space_prefix", True))}
    for key in ("scores", "token_type"):
        count = len(meta[key] or ())
        need(count in (0, len(tokens)), f"{g.path}: tokenizer.ggml.{key} has {count} entries for {len(tokens)} tokens")
    return meta


def build(g: GGUFFile) -> tuple[Tokenizer, dict[str, Any]]:
    """(the tokenizer, its tokenizer_config.json) from the file's `tokenizer.*` metadata."""
    meta = _metadata(g)
    tokens = meta["tokens"]
    try:
        tok = BUILDERS[meta["model"]](meta)
    except EdgeError:
        raise
    except Exception as exc:  # the Rust side rejects e.g. a merge naming a token that is not in the vocabulary
        raise EdgeError(f"{g.path}: cannot build the tokenizer from its metadata ({exc})") from None
    letters = set(BYTE_TO_UNICODE.values()) if meta["model"] == "gpt2" else None
    types = meta["token_type"]
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL and (letters is None or set(t) <= letters)]
    tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
                    if k == USER_DEFINED and t in vocab])

    config: dict[str, Any] = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = "padding" if name == "pad" else "unknown" if name == "unk" else name
        index = g.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
    for name in (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]):
        if name is not None:  # transformers marks the named special tokens special even when the file does not
            tok.add_special_tokens([AddedToken(name, normalized=False, special=True)])
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    add_bos = (meta["model"] == "llama") if add_bos is None else bool(add_bos)
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and config["bos_token"] is not None, add_eos and config["eos_token"] is not None
    tok.post_processor = _post_processor(tok, config, add_bos, add_eos)
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = g.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, config


def _post_processor(tok: Tokenizer, config: dict[str, Any], add_bos: bool, add_eos: bool):
    """transformers' update_post_processor: `<bos> $A <eos>` with the flags that are on."""
    bos, eos = config["bos_token"], config["eos_token"]
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


_DIRS: list[Path] = []


def _cleanup() -> None:
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


def write_tokenizer(g: GGUFFile) -> Path | None:
    """tokenizer.json + tokenizer_config.json in a directory that lives as long as this process; the path of
    tokenizer.json, or None when the file has no tokenizer metadata."""
    if not g.has("tokenizer.ggml.model"):
        return None
    tok, config = build(g)
    if not _DIRS:
        atexit.register(_cleanup)
    folder = Path(tempfile.mkdtemp(prefix="edgellm-gguf-tok-"))
    _DIRS.append(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return folder / "tokenizer.json"
