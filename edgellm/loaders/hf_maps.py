"""Hugging Face tensor names -> edgellm state-dict names: one declarative map per family.

Each entry maps an edgellm name to the HF tensors concatenated along dim 0 into it, which is how the fusions
are declared: q|k|v -> `attn.qkv`, gate|up -> `mlp.gate_up` (see docs/design.md for the edgellm names).
Per-layer entries are relative to `layers.{i}.` on our side and `layer_prefix` on theirs. A map lists every
tensor the family may have; the model built from the translated config decides which are wanted (biases only
with `qkv_bias`, q/k norms only with `qk_norm`, `lm_head` only without tied embeddings).

HF checkpoints store q/k in rotate-half order, which is `rope_style="half"`: no permutation is needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from edgellm.runtime.errors import EdgeError

from .tensors import Plan


@dataclass(frozen=True)
class WeightMap:
    top: dict[str, tuple[str, ...]]  # edgellm name -> HF names, outside the layers
    layer: dict[str, tuple[str, ...]]  # per layer: edgellm suffix -> HF suffixes
    layer_prefix: str = "model.layers.{i}."
    ignored: tuple[str, ...] = ()  # regexes of HF tensors that hold no weights (e.g. cached RoPE tables)
    transposed: tuple[str, ...] = ()  # regexes of HF tensors stored [in, out] (GPT-2's Conv1D), read transposed

    def plan(self, targets: Iterable[str]) -> Plan:
        """The plan for these state-dict names; a name the map cannot source is an EdgeError."""
        plan: Plan = {}
        for target in targets:
            parts = target.split(".", 2)
            if parts[0] == "layers" and len(parts) == 3 and parts[2] in self.layer:
                prefix = self.layer_prefix.format(i=int(parts[1]))
                plan[target] = tuple(prefix + name for name in self.layer[parts[2]])
            elif target in self.top:
                plan[target] = self.top[target]
            else:
                raise EdgeError(f"the weight map has no source for {target}")
        return plan

    def is_ignored(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignored)

    def is_transposed(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.transposed)


_TOP = {
    "embed.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}
_ATTN = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.o.weight": ("self_attn.o_proj.weight",),
}
_QKV_BIAS = {"attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")}
_QK_NORM = {"attn.q_norm.weight": ("self_attn.q_norm.weight",), "attn.k_norm.weight": ("self_attn.k_norm.weight",)}
_MLP = {
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
_ROPE_TABLES = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)  # saved by old transformers versions


def _gpt2(prefix: str) -> WeightMap:
    """GPT-2: `transformer.` in front when saved from GPT2LMHeadModel, nothing when saved from GPT2Model (the
    original openai-community checkpoints). c_attn is q|k|v already fused in edgellm's order; the Conv1D weights
    (c_attn, c_proj, c_fc) are [in, out]; `attn.bias` / `attn.masked_bias` are causal-mask buffers."""
    norm = {"weight": "weight", "bias": "bias"}
    layer = {f"attn_norm.{k}": (f"ln_1.{v}",) for k, v in norm.items()}
    layer |= {f"mlp_norm.{k}": (f"ln_2.{v}",) for k, v in norm.items()}
    for kind in ("weight", "bias"):
        layer |= {f"attn.qkv.{kind}": (f"attn.c_attn.{kind}",), f"attn.o.{kind}": (f"attn.c_proj.{kind}",),
                  f"mlp.up.{kind}": (f"mlp.c_fc.{kind}",), f"mlp.down.{kind}": (f"mlp.c_proj.{kind}",)}
    p = re.escape(prefix)
    return WeightMap(
        top={"embed.weight": (f"{prefix}wte.weight",), "pos_embed.weight": (f"{prefix}wpe.weight",),
             "norm.weight": (f"{prefix}ln_f.weight",), "norm.bias": (f"{prefix}ln_f.bias",),
             "lm_head.weight": ("lm_head.weight",)},
        layer=layer, layer_prefix=prefix + "h.{i}.", ignored=(p + r"h\.\d+\.attn\.(bias|masked_bias)",),
        transposed=(p + r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight",))


GPT2_MAPS = {"transformer.": _gpt2("transformer."), "": _gpt2("")}


def family_map(family: str, names: set[str]) -> WeightMap:
    """The family's map; for gpt2 the one whose prefix the checkpoint's names use."""
    if family == "gpt2":
        return GPT2_MAPS["transformer." if "transformer.wte.weight" in names else ""]
    return FAMILIES[family]

_GEMMA3 = {
    **_ATTN, **_QK_NORM,
    "attn_post_norm.weight": ("post_attention_layernorm.weight",),
    "mlp_norm.weight": ("pre_feedforward_layernorm.weight",),
    "mlp_post_norm.weight": ("post_feedforward_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
# families whose RMSNorm gain is (offset + w): the offset is added to every source `*norm.weight` as it is read
NORM_OFFSET = {"gemma3_text": 1.0}

FAMILIES: dict[str, WeightMap] = {
    "llama": WeightMap(top=_TOP, layer={**_ATTN, **_MLP}, ignored=_ROPE_TABLES),
    "mistral": WeightMap(top=_TOP, layer={**_ATTN, **_MLP}, ignored=_ROPE_TABLES),
    "qwen2": WeightMap(top=_TOP, layer={**_ATTN, **_QKV_BIAS, **_MLP}, ignored=_ROPE_TABLES),
    "qwen3": WeightMap(top=_TOP, layer={**_ATTN, **_QK_NORM, **_MLP}, ignored=_ROPE_TABLES),
    # MiniCPM 1/2/4 (remote code "MiniCPMForCausalLM"); q/k norms only when config.json sets qk_norm
    "minicpm": WeightMap(top=_TOP, layer={**_ATTN, **_QK_NORM, **_MLP}, ignored=_ROPE_TABLES),
    "gemma3_text": WeightMap(top=_TOP, layer=_GEMMA3, ignored=_ROPE_TABLES),
}
