"""Hugging Face GPT-2 (`model_type: gpt2`) config.json -> `ModelConfig` (preset `nanogpt`).

GPT-2 is seed 004's walk-through model: learned absolute positions (`wpe`), LayerNorm with bias, a GELU MLP of
`n_inner` (default 4 D), biases on every linear, multi-head attention, a head tied to `wte`. Anything that would
change the numbers is an EdgeError naming the key: attention not scaled by 1/sqrt(hd) (`scale_attn_weights`),
scaled by 1/layer (`scale_attn_by_inverse_layer_idx`), `reorder_and_upcast_attn`, cross-attention, and
activations other than gelu / gelu_new (tanh) / gelu_pytorch_tanh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgellm.runtime.errors import need

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# key -> the value edgellm computes; HF's defaults
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
          "add_cross_attention": False}


def _get(hf: dict[str, Any], keys: tuple[str, ...], where: Path, default: Any = None) -> Any:
    """The first of `keys` present (GPT2Config's own name, then the attribute_map alias)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    need(default is not None, f"{where}: missing {keys[0]}")
    return default


def _positive(value: Any, key: str, where: Path) -> int:
    need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
         f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def gpt2_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelConfig fields of a GPT-2 config.json (bos/eos/end ids and provenance are the caller's)."""
    for key, want in _FIXED.items():
        need(hf.get(key, want) == want, f"{where}: {key}={hf.get(key)!r} is not supported (expected {want})")
    act = hf.get("activation_function", "gelu_new")
    need(act in ACTIVATIONS, f"{where}: activation_function {act!r} is not supported (expected one of "
         f"{', '.join(ACTIVATIONS)})")
    dim = _positive(_get(hf, ("n_embd", "hidden_size"), where), "n_embd", where)
    heads = _positive(_get(hf, ("n_head", "num_attention_heads"), where), "n_head", where)
    need(dim % heads == 0, f"{where}: n_embd {dim} is not divisible by n_head {heads}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    need(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0,
         f"{where}: layer_norm_epsilon must be a positive number, got {eps!r}")
    tie = hf.get("tie_word_embeddings", True)
    return dict(
        preset="nanogpt", vocab_size=_positive(hf.get("vocab_size"), "vocab_size", where), dim=dim,
        n_layers=_positive(_get(hf, ("n_layer", "num_hidden_layers"), where), "n_layer", where),
        n_heads=heads, n_kv_heads=heads, head_dim=None,
        hidden_dim=_positive(_get(hf, ("n_inner",), where, 4 * dim), "n_inner", where),
        max_seq_len=_positive(_get(hf, ("n_positions", "max_position_embeddings"), where), "n_positions", where),
        norm_eps=float(eps), pos_embedding="learned", norm_kind="layer", mlp_kind=ACTIVATIONS[act],
        linear_bias=True, qkv_bias=False, qk_norm=False, tie_embeddings=bool(tie))

