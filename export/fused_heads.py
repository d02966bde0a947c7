"""Head sizes in the fused layers (issue 21): which head sizes onnxruntime's GroupQueryAttention takes, how the
others are zero-padded, where RoPE goes, and the line that says so in the manifest and the export table."""

from __future__ import annotations

import numpy as np

from edgellm.model import ModelConfig
from edgellm.runtime.graphio import ring_layers

# onnxruntime's CPU GroupQueryAttention (1.22 through 1.32, probed: issue 21) takes head sizes that are a multiple
# of 8, and with its RoPE inside (do_rotary=1) a multiple of 16; its RotaryEmbedding op takes any even size.
GQA_HEAD_MULTIPLE = 8
GQA_ROPE_HEAD_MULTIPLE = 16


def cache_head_dim(cfg: ModelConfig) -> int:
    """The width of a cache row in the fused layers: the head size, or the next multiple of 8 when
    GroupQueryAttention refuses it (every head zero-padded: q/k/v weights get zero rows, o zero columns, RoPE
    rotates the first hd entries only; exact, the cache grows by hd_pad / hd). Recorded as kv_head_dim."""
    return -(-cfg.hd // GQA_HEAD_MULTIPLE) * GQA_HEAD_MULTIPLE


def pad_heads(w: np.ndarray, hd: int, hd_pad: int) -> np.ndarray:
    """[..., heads * hd] -> [..., heads * hd_pad]: each head's hd entries, then zeros."""
    if hd_pad == hd:
        return w
    heads = w.reshape(*w.shape[:-1], -1, hd)
    pad = [(0, 0)] * (heads.ndim - 1) + [(0, hd_pad - hd)]
    return np.pad(heads, pad).reshape(*w.shape[:-1], -1)


def rope_in_gqa(cfg: ModelConfig) -> bool:
    """RoPE inside GroupQueryAttention (its one cos/sin cache): no XPos scales and a head size its RoPE takes;
    otherwise two RotaryEmbedding ops rotate q and k before it (same tables, same cache layout, 2 more ops)."""
    return cfg.rotary and not cfg.xpos and cfg.hd % GQA_ROPE_HEAD_MULTIPLE == 0


def attention_record(cfg: ModelConfig, attention: str, granularity: str, max_seq: int,
                     sliding_cache: str = "ring") -> str:
    """How the layers attend, for the manifest's export_options and the export table."""
    if granularity == "model":
        return "standard ONNX ops (traced model graph)"
    if attention == "standard":
        return "standard ONNX ops"
    if any(ring_layers(cfg.to_dict(), max_seq, sliding_cache=sliding_cache)):
        return ("fused GroupQueryAttention for full layers; sliding-window layers: ring cache written by "
                "ScatterElements, attention in standard ops")
    window = cfg.sliding_window if cfg.layer_types and "sliding" in cfg.layer_types else None
    sliding = ("" if window is None else f"; sliding-window layers too (their window {window} covers max_seq)"
               if window >= max_seq else f"; sliding-window layers too (full-length caches, local_window_size {window})")
    return _fused(cfg) + sliding


def _fused(cfg: ModelConfig) -> str:
    """How fused GroupQueryAttention takes the positions: RoPE inside or before it, or none."""
    if rope_in_gqa(cfg):
        return "fused GroupQueryAttention, RoPE inside"
    hd, pad = cfg.hd, cache_head_dim(cfg)
    if not cfg.rotary:
        padded = f", heads zero-padded {hd}->{pad} (kv_head_dim {pad})" if pad != hd else ""
        return f"fused GroupQueryAttention{padded}, no RoPE ({cfg.pos_embedding} positions added by the embedding)"
    if pad != hd:
        return (f"fused GroupQueryAttention, heads zero-padded {hd}->{pad} (kv_head_dim {pad}), RoPE as 2 "
                "RotaryEmbedding ops before it")
    why = "XPos scales" if cfg.xpos else f"head_dim {hd} % {GQA_ROPE_HEAD_MULTIPLE} != 0"
    return f"fused GroupQueryAttention, RoPE as 2 RotaryEmbedding ops before it ({why})"
