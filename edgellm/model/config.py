"""`ModelConfig`: one dataclass for every architecture edgellm supports, and its named presets.

A preset is an architecture (norm flavour, RoPE flavour, scalings) with a default size; sizes are
overridden with `ModelConfig.preset(name, dim=..., n_layers=...)`. Every field is plain data, so a
config round-trips through JSON (checkpoints and export manifests carry it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.graphio import MAX_LAYERS


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "llama2"
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None -> n_heads (multi-head attention); fewer -> GQA
    head_dim: int | None = None  # None -> dim // n_heads (Qwen3 sets it explicitly)
    hidden_dim: int = 688  # SwiGLU inner size F
    max_seq_len: int = 512  # max positions the model is built for (LongRoPE's "cached length")
    norm_eps: float = 1e-5
    # "add": x * rsqrt(mean(x^2) + eps) (Llama, HF, seed 003); "clamp": rsqrt(clamp_min(mean(x^2), eps)) (seed 000)
    norm_eps_mode: str = "add"
    # "half": rotate-half pairs (x_i, x_{i+hd/2}) (HF); "interleaved": pairs (x0,x1),(x2,x3)... (seed 003, Meta, llama2.c)
    rope_style: str = "half"
    rope_theta: float = 10000.0
    # LongRoPE (seed 002): per-frequency divisors, switched on the context length vs rope_original_max
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    rope_original_max: int | None = None
    # XPos (seed 000): q * scale, k / scale, scale = ((2i/d + 0.4)/1.4) ** ((pos - center) / scale_base)
    xpos: bool = False
    xpos_scale_base: float = 512.0
    xpos_center: int | None = None  # None -> max_seq_len // 2 (fixed, so cached keys stay valid)
    qkv_bias: bool = False
    # GPT-2 / nano-gpt (seed 004): "rope" (rotary inside attention), "learned" (a trained [max_seq_len, D] table
    # added to the token embeddings) or "sinusoidal" (seed 004's fixed sin/cos table, added the same way)
    pos_embedding: str = "rope"
    norm_kind: str = "rms"  # "rms": RMSNorm (gain only); "layer": LayerNorm (mean removed, gain and bias)
    mlp_kind: str = "swiglu"  # "swiglu" (gated); "gelu" (exact erf) or "gelu_tanh" (GPT-2's gelu_new): up -> act -> down
    linear_bias: bool = False  # a bias on every linear of a block: qkv, o, the MLP's (GPT-2); the head has none
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, MiniCPM4 option)
    tie_embeddings: bool = False
    # MiniCPM (seed 002): embeddings * scale_emb; branches * scale_depth / sqrt(L); hidden / (dim / dim_model_base)
    scale_emb: float = 1.0
    scale_depth: float | None = None
    dim_model_base: int | None = None
    # StellarByte (seed 000): LayerScale gammas (init value) and DropPath; dropouts act only in training
    layerscale_init: float | None = None
    drop_path: float = 0.0
    dropout: float = 0.0
    # Gemma 2/3 (all defaults off): a norm on each branch's output before its residual add ("sandwich" norms);
    # the gated MLP's activation ("silu": SwiGLU; "gelu_tanh": GeGLU with tanh-approximated GELU); the softmax
    # scale of q.k (None: 1/sqrt(head_dim); Gemma: query_pre_attn_scalar ** -0.5)
    post_norms: bool = False
    glu_act: str = "silu"
    attn_scale: float | None = None
    # Sliding-window attention (Gemma 3): layer_types[i] is "full" or "sliding" (None: all full); a sliding
    # layer attends to keys with q_pos - k_pos < sliding_window, RoPE base rope_local_theta (None: rope_theta)
    # and no RoPE factors (those scale the full layers only, as Gemma 3's rope_parameters per layer type do)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    bos_id: int | None = 1
    eos_id: int | None = 2
    # ids besides eos_id that end generation (an instruct model's end-of-turn token: Qwen's <|im_end|>, Llama 3's
    # <|eot_id|>); export writes eos_id and these as the manifest's eos_ids
    end_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # provenance only, never behaviour

    def __post_init__(self) -> None:
        _check_types(self)  # configs come from untrusted JSON: "dim": "64", true, NaN must not reach torch
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        need(self.preset in PRESETS, f"unknown preset {self.preset!r}; expected one of {', '.join(PRESETS)}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.head_dim is None or self.head_dim > 0, f"head_dim must be positive, got {self.head_dim}")
        need(self.n_layers <= MAX_LAYERS, f"n_layers={self.n_layers} is more than {MAX_LAYERS} (corrupt config?)")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        need(self.head_dim is not None or self.dim % self.n_heads == 0,
             f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        need(self.pos_embedding in POS_EMBEDDINGS,
             f"pos_embedding must be one of {'|'.join(POS_EMBEDDINGS)}, got {self.pos_embedding!r}")
        need(self.norm_kind in ("rms", "layer"), f"norm_kind must be rms|layer, got {self.norm_kind!r}")
        need(self.mlp_kind in MLP_KINDS, f"mlp_kind must be one of {'|'.join(MLP_KINDS)}, got {self.mlp_kind!r}")
        need(not self.rotary or self.hd % 2 == 0, f"head_dim={self.hd} must be even for RoPE")
        need(self.pos_embedding != "sinusoidal" or self.dim % 2 == 0,
             f"dim={self.dim} must be even for sinusoidal positions")
        need(self.rotary or not self.xpos, "xpos scales rotary embeddings: it needs pos_embedding 'rope'")
        need(self.norm_eps_mode in ("add", "clamp"), f"norm_eps_mode must be add|clamp, got {self.norm_eps_mode!r}")
        need(self.rope_style in ("half", "interleaved"), f"rope_style must be half|interleaved, got {self.rope_style!r}")
        for name in ("rope_short_factor", "rope_long_factor"):
            factor = getattr(self, name)
            if factor is not None:
                need(isinstance(factor, (list, tuple)) and all(_is_number(f) for f in factor),
                     f"{name}: expected a list of finite numbers")
                object.__setattr__(self, name, tuple(float(f) for f in factor))
                need(len(factor) == self.hd // 2, f"{name} needs head_dim/2={self.hd // 2} values, got {len(factor)}")
        need(isinstance(self.end_ids, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in self.end_ids),
            f"end_ids: expected a list of token ids in [0, {self.vocab_size}), got {self.end_ids!r:.60}")
        object.__setattr__(self, "end_ids", tuple(i for i in dict.fromkeys(self.end_ids) if i != self.eos_id))
        need(self.glu_act in GLU_ACTS, f"glu_act must be one of {', '.join(GLU_ACTS)}, got {self.glu_act!r}")
        need(self.attn_scale is None or self.attn_scale > 0, f"attn_scale must be positive, got {self.attn_scale}")
        need(self.sliding_window is None or self.sliding_window > 0,
             f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types is not None:
            types = self.layer_types
            need(isinstance(types, (list, tuple)) and len(types) == self.n_layers and
                 all(t in LAYER_TYPES for t in types),
                 f"layer_types: expected {self.n_layers} entries, each one of {', '.join(LAYER_TYPES)}, "
                 f"got {types!r:.80}")
            object.__setattr__(self, "layer_types", tuple(types))
            need("sliding" not in types or self.sliding_window is not None,
                 "layer_types: sliding layers need sliding_window")
        need((self.rope_long_factor is None) == (self.rope_original_max is None),
             "LongRoPE needs both rope_long_factor/rope_short_factor and rope_original_max")

    # ---- derived values (never stored, so they cannot disagree with the fields) ----
    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (keys with q_pos - k_pos < window), or None for full attention."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding"
        return self.sliding_window if sliding else None

    @property
    def scale(self) -> float:
        """The softmax scale of q.k."""
        return self.hd ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def rotary(self) -> bool:
        """Whether attention rotates q and k (RoPE); absolute position tables are added to the embeddings instead."""
        return self.pos_embedding == "rope"

    @property
    def qkv_biased(self) -> bool:
        return self.qkv_bias or self.linear_bias

    @property
    def residual_scale(self) -> float:
        """Multiplier of both residual branches: scale_depth / sqrt(L) (MiniCPM) or 1."""
        return 1.0 if self.scale_depth is None else self.scale_depth / math.sqrt(self.n_layers)

    @property
    def width_scale(self) -> float:
        """Divisor of the final hidden state before lm_head: dim / dim_model_base (MiniCPM) or 1."""
        return 1.0 if self.dim_model_base is None else self.dim / self.dim_model_base

    @property
    def center(self) -> int:
        return self.max_seq_len // 2 if self.xpos_center is None else self.xpos_center

    # ---- construction and (de)serialisation ----
    @classmethod
    def preset_config(cls, name: str, **overrides: Any) -> ModelConfig:
        need(name in PRESETS, f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        data = {**PRESETS[name], **overrides}
        if data.get("rope_long_factor") is not None and "rope_long_factor" not in overrides:
            # the preset's illustrative LongRoPE factors follow the head size chosen by the overrides
            probe = cls.from_dict({**data, "rope_short_factor": None, "rope_long_factor": None,
                                   "rope_original_max": None})
            data.update(_minicpm_factors(probe.hd // 2))
        if data["preset"] == "gemma3":  # the preset's pattern and embedding scale follow the overridden sizes
            n = data.get("n_layers", cls.n_layers)
            data.setdefault("layer_types", tuple("full" if i % 6 == 5 or i == n - 1 else "sliding" for i in range(n)))
            data.setdefault("scale_emb", math.sqrt(data.get("dim", cls.dim)))
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise EdgeError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("rope_short_factor", "rope_long_factor", "end_ids", "layer_types"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def n_params(self) -> int:
        hd, d = self.hd, self.dim
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * d
        attn += (self.n_heads + 2 * self.n_kv_heads) * hd if self.qkv_biased else 0
        attn += d if self.linear_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        gated = self.mlp_kind == "swiglu"
        mlp = (3 if gated else 2) * d * self.hidden_dim
        mlp += ((2 if gated else 1) * self.hidden_dim + d) if self.linear_bias else 0
        norm = 2 * d if self.norm_kind == "layer" else d
        layer = attn + mlp + (4 if self.post_norms else 2) * norm + (2 * d if self.layerscale_init is not None else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        pos = self.max_seq_len * d if self.pos_embedding == "learned" else 0
        return self.vocab_size * d + pos + self.n_layers * layer + norm + head


POS_EMBEDDINGS = ("rope", "learned", "sinusoidal")
MLP_KINDS = ("swiglu", "gelu", "gelu_tanh")
GLU_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "bool": bool, "str": str,
                                              "dict[str, Any]": dict}
_JSON_NAMES = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
               "dict[str, Any]": "an object"}


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_types(cfg: ModelConfig) -> None:
    """Each field holds its annotated type (ints are not bools, numbers are finite); LongRoPE factors are
    checked where they are converted."""
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), f.type.split(" | ")[0]
        if (value is None and f.type.endswith("| None")) or kind not in _TYPES:
            continue
        ok = _is_number(value) if kind == "float" else (
            isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool)))
        need(ok, f"{f.name}: expected {_JSON_NAMES[kind]}{' or null' if f.type.endswith('| None') else ''}, "
                 f"got {value!r:.40}")


def _minicpm_factors(n: int) -> dict[str, Any]:
    # Illustrative LongRoPE factors (MiniCPM4 ships its own per checkpoint): long factors grow with the
    # wavelength, so low frequencies are stretched most; short factors are all 1.
    return {
        "rope_short_factor": tuple(1.0 for _ in range(n)),
        "rope_long_factor": tuple(1.0 + 3.0 * i / max(n - 1, 1) for i in range(n)),
    }


# Architectures (seeds and HF families) at a small default size; HF/llama2.c loaders set real sizes.
PRESETS: dict[str, dict[str, Any]] = {
    "llama2": dict(preset="llama2", n_kv_heads=4),
    "from-scratch": dict(preset="from-scratch", rope_style="interleaved", tie_embeddings=True),
    "stellarbyte": dict(preset="stellarbyte", norm_eps_mode="clamp", xpos=True, xpos_scale_base=512.0,
                        layerscale_init=1e-2, drop_path=0.0, dropout=0.0, norm_eps=1e-6),
    "minicpm4": dict(preset="minicpm4", qk_norm=True, scale_emb=12.0, scale_depth=1.4, dim_model_base=64,
                     max_seq_len=1024, rope_original_max=512, tie_embeddings=True, n_kv_heads=2,
                     **_minicpm_factors(16)),
    "qwen2": dict(preset="qwen2", qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6, n_kv_heads=2,
                  tie_embeddings=True),
    "qwen3": dict(preset="qwen3", qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6, n_kv_heads=2,
                  head_dim=64, tie_embeddings=True),
    "mistral": dict(preset="mistral", rope_theta=1_000_000.0, n_kv_heads=2),
    # seed 004's walk-through model / GPT-2: learned absolute positions, LayerNorm, GELU (tanh) MLP of 4 D,
    # biases on every block linear, tied head, multi-head attention, no RoPE
    "nanogpt": dict(preset="nanogpt", pos_embedding="learned", norm_kind="layer", mlp_kind="gelu_tanh",
                    linear_bias=True, tie_embeddings=True, hidden_dim=1024, max_seq_len=256),
    # Gemma 3 (text): norm gains (1 + w) are folded into the weights at load time (loaders), so the norms here
    # are plain RMSNorms; layer_types (5 sliding : 1 full, the last layer full) and scale_emb = sqrt(dim) are set by preset_config
    "gemma3": dict(preset="gemma3", qk_norm=True, post_norms=True, glu_act="gelu_tanh", norm_eps=1e-6,
                   n_kv_heads=1, head_dim=64, sliding_window=64, rope_theta=1_000_000.0,
                   rope_local_theta=10_000.0, tie_embeddings=True, bos_id=2, eos_id=1),
}

# Reference shapes used by the benchmarks (random weights), on top of the architecture presets.
SHAPES: dict[str, dict[str, Any]] = {
    "stories15m": dict(preset="llama2", dim=288, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=768,
                       vocab_size=32000, max_seq_len=256),
    "stories110m": dict(preset="llama2", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048,
                        vocab_size=32000, max_seq_len=1024),
    "qwen2.5-0.5b": dict(preset="qwen2", dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864,
                         vocab_size=151936, max_seq_len=2048, tie_embeddings=True),
}
