"""Hugging Face `config.json` -> `ModelConfig`, for the llama, mistral, qwen2, qwen3, minicpm and gemma3_text
families (Gemma 3's own fields: hf_gemma3.py) and gpt2 (whose fields hf_gpt2.py translates).

Every behavioural field is set explicitly (nothing leaks from the preset's small defaults). Policy for
features edgellm's decoder does not have: anything that would change the numbers is an EdgeError, except
a sliding window shorter than the position range, which is exact up to the window: the config is loaded
with `max_seq_len` = window and a warning says so.

RoPE: transformers 5 writes `rope_parameters` {"rope_theta", "rope_type", ...}, older versions `rope_theta`
plus `rope_scaling`; both are read. Supported types: default; linear and llama3 (static per-frequency
divisors, carried exactly by the LongRoPE factor fields with long == short and no attention scaling);
longrope for minicpm only (MiniCPM's remote code picks long/short factors by the context the tables are
built for, which is what edgellm does; transformers' own longrope picks them per forward call).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from edgellm.model import ModelConfig
from edgellm.runtime.errors import EdgeError, need

from .hf_gemma3 import gemma3_fields
from .hf_gpt2 import gpt2_fields

PRESETS = {"llama": "llama2", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "minicpm": "minicpm4",
           "gpt2": "nanogpt", "gemma3_text": "gemma3"}


def _int(hf: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = hf.get(key, default)
    need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
         f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _float(value: Any, key: str, where: Path) -> float:
    need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
         f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _token(value: Any, key: str, where: Path) -> int | None:
    """bos/eos id: an int, None, or a list whose first entry is used (all are kept in `extra`)."""
    if isinstance(value, list):
        value = value[0] if value else None
    need(value is None or (isinstance(value, int) and not isinstance(value, bool)),
         f"{where}: {key} must be an integer or a list of them, got {value!r}")
    return value


def _ids(value: Any) -> list[int]:
    """The integer ids in an eos_token_id value (an int, a list of them, or null)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def rope_fields(hf: dict[str, Any], family: str, hd: int, max_pos: int, where: Path) -> dict[str, Any]:
    """rope_theta and the factor fields of ModelConfig from rope_parameters / rope_theta + rope_scaling."""
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    need(isinstance(params, dict) and isinstance(scaling, dict),
         f"{where}: rope_parameters / rope_scaling must be objects")
    need(not any(isinstance(v, dict) for v in params.values()),
         f"{where}: per-layer-type rope_parameters are not supported")
    rope = {**scaling, **params}
    theta = _float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", where)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    need(_float(hf.get("partial_rotary_factor", 1.0), "partial_rotary_factor", where) == 1.0,
         f"{where}: partial_rotary_factor < 1 is not supported")
    out: dict[str, Any] = dict(rope_theta=theta, rope_short_factor=None, rope_long_factor=None,
                               rope_original_max=None)
    inv = [theta ** (-2.0 * i / hd) for i in range(hd // 2)]
    if kind == "default":
        return out
    if kind == "linear":
        divisors = [_float(rope.get("factor"), "rope factor", where)] * (hd // 2)
    elif kind == "llama3":
        divisors = _llama3_divisors(rope, inv, where)
    elif kind == "longrope" and family == "minicpm":
        short, long = rope.get("short_factor"), rope.get("long_factor")
        need(isinstance(short, list) and isinstance(long, list) and len(short) == len(long) == hd // 2,
             f"{where}: longrope needs short_factor and long_factor lists of head_dim/2 = {hd // 2} numbers")
        original = _int(rope, "original_max_position_embeddings", where)
        return {**out, "rope_short_factor": tuple(_float(f, "short_factor", where) for f in short),
                "rope_long_factor": tuple(_float(f, "long_factor", where) for f in long),
                "rope_original_max": original}
    else:
        raise EdgeError(f"{where}: rope type {kind!r} is not supported for {family} "
                        f"(supported: default, linear, llama3{', longrope' if family == 'minicpm' else ''})")
    # static divisors: long == short, original max == max positions so the LongRoPE attention scale is 1
    return {**out, "rope_short_factor": tuple(divisors), "rope_long_factor": tuple(divisors),
            "rope_original_max": max_pos}


def _llama3_divisors(rope: dict[str, Any], inv: list[float], where: Path) -> list[float]:
    """Llama 3.1 frequency scaling as divisors of the base inverse frequencies (long waves / factor,
    short waves unchanged, a smooth blend between)."""
    factor = _float(rope.get("factor"), "rope factor", where)
    low = _float(rope.get("low_freq_factor"), "low_freq_factor", where)
    high = _float(rope.get("high_freq_factor"), "high_freq_factor", where)
    old = _int(rope, "original_max_position_embeddings", where)
    need(high > low, f"{where}: llama3 rope needs high_freq_factor > low_freq_factor")
    divisors = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return divisors


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window actually used by some layer, or None."""
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def hf_to_config(hf: dict[str, Any], generation: dict[str, Any], has_lm_head: bool, where: Path) -> ModelConfig:
    """Translate config.json (+ generation_config.json for missing bos/eos); `has_lm_head` settles tying when
    config.json does not say (MiniCPM remote-code configs)."""
    family = hf.get("model_type")
    need(family != "gemma3", f"{where}: model_type 'gemma3' is the multimodal Gemma 3 (vision + text); edgellm "
                             "loads the text-only Gemma3ForCausalLM (model_type 'gemma3_text', e.g. Gemma 3 270M/1B)")
    need(family in PRESETS, f"{where}: model_type {family!r} is not supported (expected one of "
         f"{', '.join(PRESETS)})")
    need("quantization_config" not in hf, f"{where}: quantized checkpoints are not supported (load the fp16/fp32 "
         f"weights; edgellm quantizes after export)")
    fields = gpt2_fields(hf, where) if family == "gpt2" else _llama_fields(hf, family, has_lm_head, where)
    for key, field in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        value = hf.get(key) if hf.get(key) is not None else generation.get(key)
        fields[field] = _token(value, key, where)
    if family == "minicpm":
        fields.update(_minicpm_fields(hf, where))
    # every id that ends generation, config.json's first: instruct models list their end-of-turn token in
    # generation_config.json (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>; Llama 3.1: three ids)
    eos = _ids(hf.get("eos_token_id")) + _ids(generation.get("eos_token_id"))
    vocab = fields["vocab_size"]
    fields["end_ids"] = [i for i in eos if 0 <= i < vocab]  # ModelConfig drops eos_id and repeats
    fields["extra"] = {"source": "hf", "model_type": family}
    try:
        return ModelConfig.from_dict(fields)
    except EdgeError as exc:
        raise EdgeError(f"{where}: {exc}") from None


def _llama_fields(hf: dict[str, Any], family: str, has_lm_head: bool, where: Path) -> dict[str, Any]:
    """The fields of the RoPE / RMSNorm / SwiGLU families (llama, mistral, qwen2, qwen3, minicpm)."""
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    need(act == "silu" or family == "gemma3_text", f"{where}: hidden_act {act!r} is not supported (expected silu)")
    need(not hf.get("mlp_bias", False), f"{where}: mlp_bias=true is not supported")
    need(family == "qwen2" or not hf.get("attention_bias", False),
         f"{where}: attention_bias=true (biased o_proj) is not supported for {family}")

    dim, heads = _int(hf, "hidden_size", where), _int(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim") or hf.get("kv_channels") or dim // heads
    need(isinstance(head_dim, int) and head_dim > 0, f"{where}: head_dim must be a positive integer")
    max_pos = _int(hf, "max_position_embeddings", where)
    window = _sliding_window(hf) if family != "gemma3_text" else None  # gemma3: per-layer windows, exact
    if window is not None:
        need(isinstance(window, int) and window > 0, f"{where}: sliding_window must be a positive integer")
        if window < max_pos:
            warnings.warn(f"{where}: sliding_window {window} < max_position_embeddings {max_pos}; edgellm has no "
                          f"sliding window, so max_seq_len is set to {window} (exact up to that length)",
                          stacklevel=3)
            max_pos = window

    tie = hf.get("tie_word_embeddings")
    tie = (not has_lm_head) if tie is None else bool(tie)
    fields: dict[str, Any] = dict(
        preset=PRESETS[family], vocab_size=_int(hf, "vocab_size", where), dim=dim,
        n_layers=_int(hf, "num_hidden_layers", where), n_heads=heads,
        n_kv_heads=_int(hf, "num_key_value_heads", where, default=heads),
        head_dim=None if head_dim == dim // heads and dim % heads == 0 else head_dim,
        hidden_dim=_int(hf, "intermediate_size", where), max_seq_len=max_pos,
        norm_eps=_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", where), norm_eps_mode="add",
        rope_style="half", qkv_bias=family == "qwen2", qk_norm=family == "qwen3", tie_embeddings=tie,
    )
    fields.update(gemma3_fields(hf, head_dim, max_pos, where, rope_fields) if family == "gemma3_text" else
                  rope_fields(hf, family, head_dim, max_pos, where))
    return fields


def _minicpm_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """MiniCPM's muP scalings (seed 002), required: their defaults differ between MiniCPM code versions."""
    missing = [k for k in ("scale_emb", "scale_depth", "dim_model_base") if k not in hf]
    need(not missing, f"{where}: minicpm needs {', '.join(missing)}")
    need(hf.get("use_mup", True) is True, f"{where}: use_mup=false (MiniCPM without muP scalings) is not supported")
    need(not hf.get("sparse_config"), f"{where}: MiniCPM4 sparse attention (sparse_config) is not supported")
    return dict(scale_emb=_float(hf["scale_emb"], "scale_emb", where),
                scale_depth=_float(hf["scale_depth"], "scale_depth", where),
                dim_model_base=_int(hf, "dim_model_base", where), qk_norm=bool(hf.get("qk_norm", False)))
