"""Rotary position embeddings, computed from absolute positions (never from cached tables), so the same
code runs in training, in cached decoding and inside the exported graphs.

Flavours (all from `ModelConfig`):
- rotate-half (HF, MiniCPM) or interleaved pairs (seed 003, Meta/llama2.c weights);
- LongRoPE (seed 002): inverse frequencies divided by the long or short factors, chosen by whether the
  context length exceeds `rope_original_max`; cos/sin multiplied by sqrt(1 + ln s / ln original_max),
  s = max_seq_len / rope_original_max (1 when s <= 1);
- sliding-window layers (Gemma 3) get their own table: base rope_local_theta, no factors;
- XPos (seed 000): q * scale and k / scale before rotation, scale = ((2i/d + 0.4)/1.4) ** ((pos - c)/scale_base)
  with a fixed centre c, so q.k depends on positions only through their difference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, context_len: int, local: bool = False) -> Tensor:
    """[hd/2] float32: theta^(-2i/hd), divided by the LongRoPE factors picked for `context_len`. `local`: the
    sliding-window layers' table (Gemma 3): base rope_local_theta, no factors."""
    hd = cfg.hd
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if cfg.rope_long_factor is not None and not local:
        long = context_len > cfg.rope_original_max
        factors = cfg.rope_long_factor if long else cfg.rope_short_factor
        inv = inv / torch.tensor(factors, dtype=torch.float32)
    return inv


def longrope_mscale(cfg: ModelConfig) -> float:
    """The LongRoPE attention scaling applied to cos and sin (1 without LongRoPE or when s <= 1)."""
    if cfg.rope_long_factor is None:
        return 1.0
    s = cfg.max_seq_len / cfg.rope_original_max
    return 1.0 if s <= 1.0 else math.sqrt(1.0 + math.log(s) / math.log(cfg.rope_original_max))


def xpos_base(cfg: ModelConfig) -> Tensor:
    """[hd/2] float32: (2i/hd + 0.4) / 1.4, the per-frequency XPos base raised to (pos - c)/scale_base."""
    hd = cfg.hd
    return (torch.arange(0, hd, 2, dtype=torch.float32) / hd + 0.4) / 1.4


def _spread(x: Tensor, style: str) -> Tensor:
    """[..., hd/2] per-frequency values -> [..., hd] in the layout the rotation pairs them in."""
    if style == "half":
        return torch.cat((x, x), dim=-1)
    return torch.stack((x, x), dim=-1).flatten(-2)


def rotate(x: Tensor, style: str) -> Tensor:
    """The 90-degree turn of every pair: rotate-half cat(-x2, x1), or (-x1, x0) on interleaved pairs."""
    if style == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


class Rotary(nn.Module):
    """positions [B,S] -> cos, sin, q_scale, k_scale, each [B,1,S,hd] (scales are None without XPos)."""

    def __init__(self, cfg: ModelConfig, context_len: int | None = None, local: bool = False) -> None:
        super().__init__()
        self.cfg, self.local = cfg, local
        self.mscale = 1.0 if local else longrope_mscale(cfg)
        self.register_buffer("inv_freq", inverse_frequencies(cfg, context_len or cfg.max_seq_len, local),
                             persistent=False)
        self.register_buffer("xpos_base", xpos_base(cfg) if cfg.xpos else torch.empty(0), persistent=False)

    def set_context_len(self, context_len: int) -> None:
        self.inv_freq = inverse_frequencies(self.cfg, context_len, self.local).to(self.inv_freq.device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        style = self.cfg.rope_style
        pos = positions.to(torch.float32)[:, None, :, None]  # [B,1,S,1]
        angles = _spread(pos * self.inv_freq, style)  # [B,1,S,hd]
        cos, sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        if not self.cfg.xpos:
            return cos, sin, None, None
        power = (pos - self.cfg.center) / self.cfg.xpos_scale_base
        scale = _spread(self.xpos_base ** power, style)  # [B,1,S,hd]
        return cos, sin, scale, 1.0 / scale


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, scale: Tensor | None, style: str) -> Tensor:
    """x [B,heads,S,hd] -> rotated (after the XPos scale, if any), computed in float32."""
    dtype = x.dtype
    x = x.to(torch.float32)
    if scale is not None:
        x = x * scale
    return (x * cos + rotate(x, style) * sin).to(dtype)


def sinusoidal_table(n_pos: int, dim: int) -> Tensor:
    """Seed 004's (and "Attention Is All You Need"'s) position encoding, [n_pos, dim] float32:
    PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(p / 10000^(2i/dim)), sin and cos alternating."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    angles = pos / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [n_pos, dim/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(torch.float32)
