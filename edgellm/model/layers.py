"""The decoder's building blocks: RMSNorm, attention over a static KV cache, SwiGLU, the block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .rope import Rotary, apply_rotary


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in float32 (eps added, or clamped under it for seed 000)."""

    def __init__(self, dim: int, eps: float, mode: str = "add") -> None:
        super().__init__()
        self.eps, self.clamp = eps, mode == "clamp"
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.float32)
        ms = xf.pow(2).mean(-1, keepdim=True)
        inv = torch.rsqrt(ms.clamp_min(self.eps)) if self.clamp else torch.rsqrt(ms + self.eps)
        return (xf * inv * self.weight.to(torch.float32)).to(x.dtype)


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Stochastic depth: drop a sample's whole branch with probability p (training only)."""
    if not training or p == 0.0:
        return x
    keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Attention(nn.Module):
    """Fused qkv, optional per-head q/k norm, RoPE, grouped-query attention over [past | new] keys.

    The static past cache [B,KV,M,hd] is never copied or repeated per head: queries are grouped by
    the kv head they share ([B,KV,G*S,hd], G = H/KV), past and new scores are computed separately,
    joined for one softmax, and the two value products summed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd, h, kv = cfg.hd, cfg.n_heads, cfg.n_kv_heads
        self.qkv = nn.Linear(cfg.dim, (h + 2 * kv) * hd, bias=cfg.qkv_bias)
        self.o = nn.Linear(h * hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)

    def forward(self, x: Tensor, rope: tuple, past_k: Tensor | None, past_v: Tensor | None,
                past_len: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        b, s, _ = x.shape
        h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        g = h // kv
        q, k, v = self.qkv(x).split([h * hd, kv * hd, kv * hd], dim=-1)
        q = q.view(b, s, h, hd).transpose(1, 2)  # [B,H,S,hd]
        k = k.view(b, s, kv, hd).transpose(1, 2)  # [B,KV,S,hd]
        v = v.view(b, s, kv, hd).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin, q_scale, k_scale = rope
        q = apply_rotary(q, cos, sin, q_scale, cfg.rope_style)
        k = apply_rotary(k, cos, sin, k_scale, cfg.rope_style)

        qg = q.reshape(b, kv, g * s, hd) * (hd ** -0.5)  # head h = kv_head * G + group
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().repeat(g, 1)  # [G*S, S]
        scores = (qg @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B,KV,G*S,S]
        if past_k is None:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32)
            probs = F.dropout(probs, cfg.dropout, self.training)
            out = probs @ v
        else:
            m = past_k.shape[2]
            filled = torch.arange(m, device=x.device)[None, :] < past_len.view(b, 1)  # [B,M]
            past_scores = (qg @ past_k.transpose(-1, -2)).masked_fill(~filled[:, None, None, :], float("-inf"))
            probs = F.softmax(torch.cat((past_scores, scores), dim=-1), dim=-1, dtype=torch.float32)
            out = probs[..., :m] @ past_v + probs[..., m:] @ v  # [B,KV,G*S,hd]
        out = out.view(b, kv, g, s, hd).reshape(b, h, s, hd).transpose(1, 2).reshape(b, s, h * hd)
        return self.o(out), k, v


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm block: h += branch(attn); h += branch(mlp); a branch is LayerScale, depth scaling, DropPath."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary  # shared by all blocks; a layer graph computes its RoPE from positions
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_eps_mode)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_eps_mode)
        self.mlp = MLP(cfg)
        if cfg.layerscale_init is not None:
            self.ls_attn = nn.Parameter(torch.full((cfg.dim,), cfg.layerscale_init))
            self.ls_mlp = nn.Parameter(torch.full((cfg.dim,), cfg.layerscale_init))

    def _branch(self, x: Tensor, gamma: Tensor | None) -> Tensor:
        x = F.dropout(x, self.cfg.dropout, self.training)
        if gamma is not None:
            x = x * gamma
        if self.cfg.residual_scale != 1.0:
            x = x * self.cfg.residual_scale
        return drop_path(x, self.cfg.drop_path, self.training)

    def forward(self, h: Tensor, positions: Tensor, past_k: Tensor | None = None, past_v: Tensor | None = None,
                past_len: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """h [B,S,D], positions [B,S] -> (h [B,S,D], k_new, v_new [B,KV,S,hd])."""
        layerscale = self.cfg.layerscale_init is not None
        a, k, v = self.attn(self.attn_norm(h), self.rotary(positions), past_k, past_v, past_len)
        h = h + self._branch(a, self.ls_attn if layerscale else None)
        h = h + self._branch(self.mlp(self.mlp_norm(h)), self.ls_mlp if layerscale else None)
        return h, k, v
