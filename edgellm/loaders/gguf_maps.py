"""GGUF architectures edgellm loads: one declarative entry per `general.architecture`.

An entry names the edgellm preset, the tensor-name map (llama.cpp's standard names: `token_embd`,
`blk.{i}.attn_q`, ..., `output_norm`, `output`), the architecture flags the config cannot come from
metadata (qkv biases, q/k norms) and whether llama.cpp's converter permuted the Q/K rows. Adding a family is
a new entry here (plus, if its metadata differs, a branch in gguf_config).

llama.cpp's `convert_hf_to_gguf.py` (LlamaModel.permute) reorders each Q/K head's rows from the HF rotate-half
order into interleaved RoPE pairs: GGUF row 2j holds HF row j and row 2j+1 holds HF row j + hd/2. `unpermute`
undoes it (what transformers' `LlamaTensorProcessor._reverse_permute_weights` does), so the model keeps
`rope_style="half"` like every HF load. Qwen2/Qwen3 are converted without the permutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .gguf_file import Transform
from .hf_maps import WeightMap

_TOP = {
    "embed.weight": ("token_embd.weight",),
    "norm.weight": ("output_norm.weight",),
    "lm_head.weight": ("output.weight",),
}
_ATTN = {
    "attn_norm.weight": ("attn_norm.weight",),
    "attn.qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "attn.o.weight": ("attn_output.weight",),
}
_QKV_BIAS = {"attn.qkv.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias")}
_QK_NORM = {"attn.q_norm.weight": ("attn_q_norm.weight",), "attn.k_norm.weight": ("attn_k_norm.weight",)}
_MLP = {
    "mlp_norm.weight": ("ffn_norm.weight",),
    "mlp.gate_up.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.down.weight": ("ffn_down.weight",),
}
# Gemma 3: llama.cpp's converter stores every norm weight with Gemma's +1 already added (transformers' GGUF loader
# subtracts it again), which is exactly edgellm's folded gain: the norms map as they are
_GEMMA3 = {
    **_ATTN, **_QK_NORM,
    "attn_post_norm.weight": ("post_attention_norm.weight",),
    "mlp_norm.weight": ("ffn_norm.weight",),
    "mlp_post_norm.weight": ("post_ffw_norm.weight",),
    "mlp.gate_up.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.down.weight": ("ffn_down.weight",),
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 frequency divisors: read into the config, not the weights


@dataclass(frozen=True)
class GGUFFamily:
    preset: str  # edgellm preset (ModelConfig.preset)
    weights: WeightMap
    qkv_bias: bool = False
    qk_norm: bool = False
    permuted_qk: bool = False  # llama.cpp's converter reordered Q/K rows (undone by `unpermute`)
    eps_key: str = "attention.layer_norm_rms_epsilon"  # the norm epsilon's metadata key (after `{arch}.`)
    rope: bool = True  # RoPE metadata (freq_base, scaling) is read; False: the positions are a table
    fields: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the architecture fixes


def _gpt2_map() -> WeightMap:
    """llama.cpp's GPT-2 names: fused `attn_qkv` (q|k|v, edgellm's order), `position_embd`, biases everywhere.
    Its converter transposes GPT-2's Conv1D weights into the usual [out, in] (transformers transposes them
    back for its Conv1D), so nothing is transposed here; it writes `output.weight` as a copy of the table."""
    layer = {}
    for kind in ("weight", "bias"):
        layer |= {f"attn_norm.{kind}": (f"attn_norm.{kind}",), f"attn.qkv.{kind}": (f"attn_qkv.{kind}",),
                  f"attn.o.{kind}": (f"attn_output.{kind}",), f"mlp_norm.{kind}": (f"ffn_norm.{kind}",),
                  f"mlp.up.{kind}": (f"ffn_up.{kind}",), f"mlp.down.{kind}": (f"ffn_down.{kind}",)}
    top = {**_TOP, "pos_embed.weight": ("position_embd.weight",), "norm.bias": ("output_norm.bias",)}
    return WeightMap(top=top, layer=layer, layer_prefix="blk.{i}.")


def _map(**layer: tuple[str, ...]) -> WeightMap:
    return WeightMap(top=_TOP, layer=layer, layer_prefix="blk.{i}.", ignored=(r"rope_freqs\.weight",))


_LLAMA = _map(**_ATTN, **_MLP)
FAMILIES: dict[str, GGUFFamily] = {
    # llama.cpp writes Mistral 7B as "llama" (gguf_config picks the mistral preset from general.name)
    "llama": GGUFFamily("llama2", _LLAMA, permuted_qk=True),
    "mistral": GGUFFamily("mistral", _LLAMA, permuted_qk=True),
    "qwen2": GGUFFamily("qwen2", _map(**_ATTN, **_QKV_BIAS, **_MLP), qkv_bias=True),
    "qwen3": GGUFFamily("qwen3", _map(**_ATTN, **_QK_NORM, **_MLP), qk_norm=True),
    # GPT-2 (seed 004's model): llama.cpp computes its FFN with ggml_gelu, the tanh approximation (gelu_new)
    "gpt2": GGUFFamily("nanogpt", _gpt2_map(), eps_key="attention.layer_norm_epsilon", rope=False,
                       fields=dict(pos_embedding="learned", norm_kind="layer", mlp_kind="gelu_tanh",
                                   linear_bias=True)),
    "gemma3": GGUFFamily("gemma3", _map(**_GEMMA3), qk_norm=True),  # + gguf_config.gemma3_fields
}


def unpermute(heads: int) -> Transform:
    """The inverse of llama.cpp's Q/K permutation for a tensor of `heads` heads (rows = heads * hd)."""
    def undo(w: np.ndarray) -> np.ndarray:
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return undo
