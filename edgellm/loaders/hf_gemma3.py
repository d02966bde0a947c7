"""Gemma 3 text (`model_type` "gemma3_text", `Gemma3ForCausalLM`) config.json -> ModelConfig fields.

What transformers' modeling_gemma3.py computes, as edgellm fields: embeddings * sqrt(hidden_size)
(`scale_emb`); four RMSNorms per layer and per-head q/k norms, each with gain (1 + w) (the loader folds the 1
into the weights: `NORM_OFFSET`); GeGLU with tanh-GELU; softmax scale query_pre_attn_scalar ** -0.5;
`layer_types` mixing sliding-window layers (their own RoPE base, no scaling) with full-attention layers (RoPE
base and optional linear/llama3 scaling). transformers 5 writes `rope_parameters` per layer type
({"sliding_attention": {...}, "full_attention": {...}}); older configs `rope_theta`, `rope_local_base_freq`
and `rope_scaling` (full layers only). Logit softcapping (Gemma 2's) would change the numbers: refused if set.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edgellm.runtime.errors import need

# HF layer type -> ModelConfig.layer_types entry
_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def gemma3_fields(hf: dict[str, Any], hd: int, max_pos: int, where: Path, rope_fields) -> dict[str, Any]:
    """The Gemma-specific ModelConfig fields; `rope_fields` is hf_config's reader of one RoPE dict."""
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    need(act in ("gelu_pytorch_tanh", "gelu_tanh"),
         f"{where}: hidden_activation {act!r} is not supported for gemma3 (expected gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        need(hf.get(key) is None, f"{where}: {key}={hf.get(key)!r} is not supported (edgellm has no logit "
                                  "softcapping; Gemma 3 checkpoints leave it null)")
    need(not hf.get("use_bidirectional_attention"), f"{where}: use_bidirectional_attention=true is not supported")
    need(not hf.get("attention_bias", False), f"{where}: attention_bias=true is not supported for gemma3")
    n_layers, dim = hf.get("num_hidden_layers"), hf.get("hidden_size")
    need(isinstance(n_layers, int) and isinstance(dim, int) and n_layers > 0 and dim > 0,
         f"{where}: num_hidden_layers and hidden_size must be positive integers")
    types = hf.get("layer_types")
    if types is None:  # transformers' default: every `sliding_window_pattern`-th layer is full
        pattern = hf.get("sliding_window_pattern", 6)
        need(isinstance(pattern, int) and pattern > 0, f"{where}: sliding_window_pattern must be a positive integer")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    need(isinstance(types, list) and len(types) == n_layers and all(t in _TYPES for t in types),
         f"{where}: layer_types must list {n_layers} entries of {', '.join(_TYPES)}")
    window = hf.get("sliding_window")
    sliding = "sliding_attention" in types
    need(not sliding or (isinstance(window, int) and not isinstance(window, bool) and window > 0),
         f"{where}: sliding_window must be a positive integer, got {window!r}")
    scalar = hf.get("query_pre_attn_scalar", 256)
    need(isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar > 0,
         f"{where}: query_pre_attn_scalar must be a positive number, got {scalar!r}")

    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        need(isinstance(full, dict) and isinstance(local, dict), f"{where}: rope_parameters entries must be objects")
    else:  # transformers 4: rope_theta (+ rope_scaling) for full layers, rope_local_base_freq for sliding ones
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full = {"rope_theta": 1_000_000.0, **full}
    local_kind = local.get("rope_type") or local.get("type") or "default"
    need(local_kind == "default", f"{where}: rope type {local_kind!r} for sliding_attention layers is not supported")
    local_theta = local.get("rope_theta", 10_000.0)
    need(isinstance(local_theta, (int, float)) and math.isfinite(local_theta) and local_theta > 0,
         f"{where}: sliding_attention rope_theta must be a positive number, got {local_theta!r}")
    return dict(qk_norm=True, post_norms=True, glu_act="gelu_tanh", attn_scale=float(scalar) ** -0.5,
                scale_emb=dim ** 0.5, sliding_window=window if sliding else None,
                layer_types=[_TYPES[t] for t in types], rope_local_theta=float(local_theta),
                **rope_fields({"rope_parameters": full}, "gemma3_text", hd, max_pos, where))
