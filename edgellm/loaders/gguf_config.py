"""GGUF metadata -> `ModelConfig` (llama.cpp key names, `{arch}.` prefixed), for the families in gguf_maps (gpt2:
LayerNorm epsilon under `attention.layer_norm_epsilon`, no RoPE metadata, its fixed fields from the family entry).

Sizes come from the metadata and are cross-checked against the tensors later (check_plan). The vocabulary
size is the embedding's row count (llama.cpp's own rule; `{arch}.vocab_size` is optional), the token list
must fit in it. Embeddings are tied exactly when there is no `output.weight` (llama.cpp writes the output
projection only when it differs). RoPE scaling: none, linear (`rope.scaling.type` + `factor`, or the older
`rope.scale_linear`) and Llama 3.1's per-frequency divisors (the `rope_freqs.weight` tensor), both carried by
the LongRoPE factor fields with long == short (as hf_config does); yarn and others are an EdgeError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgellm.model import ModelConfig
from edgellm.runtime.errors import EdgeError, need

from .gguf_file import GGUFFile, GGUFSource
from .gguf_maps import FAMILIES, ROPE_FREQS, GGUFFamily


def family_of(g: GGUFFile) -> tuple[str, GGUFFamily]:
    """(architecture string as written, the family entry) for the file's `general.architecture`."""
    arch = g.require("general.architecture")
    need(isinstance(arch, str) and arch in FAMILIES, f"{g.path}: GGUF architecture {arch!r} is not supported "
         f"(supported: {', '.join(FAMILIES)})")
    family = FAMILIES[arch]
    name = g.get("general.name") or ""
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        family = FAMILIES["mistral"]  # llama.cpp writes Mistral as llama; transformers renames it the same way
    return arch, family


def _rope(g: GGUFFile, arch: str, hd: int, max_pos: int, source: GGUFSource) -> dict[str, Any]:
    out: dict[str, Any] = dict(rope_theta=g.number(f"{arch}.rope.freq_base", 10000.0), rope_short_factor=None,
                               rope_long_factor=None, rope_original_max=None)
    kind = g.get(f"{arch}.rope.scaling.type", "none")
    divisors: list[float] | None = None
    if kind == "linear" or (kind == "none" and g.has(f"{arch}.rope.scale_linear")):
        key = f"{arch}.rope.scaling.factor" if kind == "linear" else f"{arch}.rope.scale_linear"
        factor = g.number(key)
        divisors = None if factor == 1.0 else [factor] * (hd // 2)
    elif kind != "none":
        raise EdgeError(f"{g.path}: rope scaling type {kind!r} is not supported (supported: none, linear, "
                        f"Llama 3.1 rope_freqs)")
    if ROPE_FREQS in source:
        need(divisors is None, f"{g.path}: both rope scaling metadata and a {ROPE_FREQS} tensor")
        shape, _ = source.shape_dtype(ROPE_FREQS)
        need(shape == (hd // 2,), f"{g.path}: tensor {ROPE_FREQS} has shape {list(shape)}; expected [{hd // 2}]")
        values = source.get(ROPE_FREQS).numpy()
        need(bool(np.all(np.isfinite(values)) and np.all(values > 0)), f"{g.path}: {ROPE_FREQS} must be positive")
        divisors = [float(v) for v in values]
    if divisors is None:
        return out
    return {**out, "rope_short_factor": tuple(divisors), "rope_long_factor": tuple(divisors),
            "rope_original_max": max_pos}


def gguf_to_config(g: GGUFFile, source: GGUFSource) -> tuple[ModelConfig, GGUFFamily]:
    arch, family = family_of(g)
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    need("token_embd.weight" in source, f"{g.path}: missing tensor token_embd.weight")
    embed_shape = g.numpy_shape("token_embd.weight")
    need(len(embed_shape) == 2, f"{g.path}: tensor token_embd.weight has shape {list(embed_shape)}; expected 2-D")
    dim, heads = g.integer(key("embedding_length")), g.integer(key("attention.head_count"))
    kv_heads = g.integer(key("attention.head_count_kv"), default=heads)
    hd = g.integer(key("attention.key_length"), default=0, positive=False) or None
    rope_dims = g.integer(key("rope.dimension_count"), default=0, positive=False) or None
    if hd is None:
        hd = rope_dims if rope_dims is not None else dim // heads
    need(g.integer(key("attention.value_length"), default=hd) == hd,
         f"{g.path}: {key('attention.value_length')} != key_length is not supported")
    need(rope_dims is None or rope_dims == hd, f"{g.path}: {key('rope.dimension_count')} = {rope_dims} is not the "
         f"head size {hd} (partial rotary embeddings are not supported)")
    max_pos = g.integer(key("context_length"))
    vocab = embed_shape[0]
    need(g.integer(key("vocab_size"), default=vocab) == vocab, f"{g.path}: {key('vocab_size')} = "
         f"{g.get(key('vocab_size'))} but token_embd.weight has {vocab} rows")
    tokens = g.get("tokenizer.ggml.tokens")
    need(tokens is None or len(tokens) <= vocab, f"{g.path}: {len(tokens or ())} tokens in tokenizer.ggml.tokens "
         f"but token_embd.weight has {vocab} rows")
    fields: dict[str, Any] = dict(
        preset=family.preset, vocab_size=vocab, dim=dim, n_layers=g.integer(key("block_count")),
        n_heads=heads, n_kv_heads=kv_heads, head_dim=None if hd * heads == dim else hd,
        hidden_dim=g.integer(key("feed_forward_length")), max_seq_len=max_pos,
        norm_eps=g.number(key(family.eps_key)), norm_eps_mode="add", rope_style="half",
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, tie_embeddings="output.weight" not in source,
        **(_rope(g, arch, hd, max_pos, source) if family.rope else {}), **family.fields,
    )
    if arch == "gemma3":
        fields.update(gemma3_fields(g, arch, dim, fields["n_layers"]))
    fields.update(token_ids(g, vocab))
    types = dict(sorted(g.type_histogram().items(), key=lambda kv: -kv[1]))
    fields["extra"] = {"source": "gguf", "architecture": arch, "gguf_version": g.version,
                       "gguf_name": g.get("general.name"), "gguf_tensor_types": types}
    try:
        return ModelConfig.from_dict(fields), family
    except EdgeError as exc:
        raise EdgeError(f"{g.path}: {exc}") from None


GEMMA3_SWA_PATTERN = 6  # llama.cpp (set_swa_pattern(6)) and transformers: layer i is full iff (i + 1) % 6 == 0
GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for gemma3 (not in the metadata)


def gemma3_fields(g: GGUFFile, arch: str, dim: int, n_layers: int) -> dict[str, Any]:
    """What llama.cpp's gemma3 graph computes beyond the llama keys: embeddings * sqrt(dim), post-norms, GeGLU,
    per-head q/k norms, sliding layers (window from the metadata, the fixed 5:1 pattern, local RoPE base 1e4;
    RoPE scaling for the full layers only). Softmax scale 1/sqrt(head_dim), llama.cpp's rule for every size but
    27B (which it detects by layer count; refused here rather than guessed). Logit softcapping is refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        need(not g.has(f"{arch}.{key}"), f"{g.path}: {arch}.{key} is set; edgellm has no logit softcapping")
    need(n_layers != 62, f"{g.path}: Gemma 3 27B (62 layers) scales attention by hidden/heads, not head_dim; "
                         "not supported from GGUF (load its Hugging Face directory)")
    window = g.integer(f"{arch}.attention.sliding_window")
    types = tuple("sliding" if (i + 1) % GEMMA3_SWA_PATTERN else "full" for i in range(n_layers))
    return dict(post_norms=True, glu_act="gelu_tanh", scale_emb=dim ** 0.5, sliding_window=window,
                layer_types=types, rope_local_theta=GEMMA3_LOCAL_THETA)


def token_ids(g: GGUFFile, vocab: int) -> dict[str, Any]:
    """bos_id / eos_id from tokenizer.ggml.*_token_id; end-of-turn / end-of-message ids end generation too."""
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "eot", "eom"):
        value = g.get(f"tokenizer.ggml.{name}_token_id")
        need(value is None or (isinstance(value, int) and 0 <= value < vocab),
             f"{g.path}: tokenizer.ggml.{name}_token_id must be a token id below {vocab}, got {value!r:.40}")
        ids[name] = value
    return dict(bos_id=ids["bos"], eos_id=ids["eos"], end_ids=[i for i in (ids["eot"], ids["eom"]) if i is not None])
