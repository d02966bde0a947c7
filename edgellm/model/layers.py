"""The decoder's building blocks: RMSNorm / LayerNorm, attention over a static KV cache, SwiGLU / GELU MLP, the
block."""

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


class LayerNorm(nn.Module):
    """(x - mean) * rsqrt(var + eps) * weight + bias over the last axis, in float32 (GPT-2)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x.to(torch.float32), x.shape[-1:], self.weight.to(torch.float32),
                         self.bias.to(torch.float32), self.eps)
        return y.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The config's norm over `dim` (default: the model width)."""
    dim = cfg.dim if dim is None else dim
    return LayerNorm(dim, cfg.norm_eps) if cfg.norm_kind == "layer" else RMSNorm(dim, cfg.norm_eps, cfg.norm_eps_mode)


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
        self.qkv = nn.Linear(cfg.dim, (h + 2 * kv) * hd, bias=cfg.qkv_biased)
        self.o = nn.Linear(h * hd, cfg.dim, bias=cfg.linear_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)

    def forward(self, x: Tensor, rope: tuple | None, past_k: Tensor | None, past_v: Tensor | None,
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
        if rope is not None:  # None: absolute positions were added to the embeddings (GPT-2)
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
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=cfg.linear_bias)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GeluMLP(nn.Module):
    """GPT-2's MLP: down(gelu(up(x))), exact (erf) or tanh-approximated GELU ("gelu_new")."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.approximate = "tanh" if cfg.mlp_kind == "gelu_tanh" else "none"
        self.up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.linear_bias)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm block: h += branch(attn); h += branch(mlp); a branch is LayerScale, depth scaling, DropPath."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary  # shared by all blocks; a layer graph computes its RoPE from positions; None: no RoPE
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg) if cfg.mlp_kind == "swiglu" else GeluMLP(cfg)
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
        rope = self.rotary(positions) if self.rotary is not None else None
        a, k, v = self.attn(self.attn_norm(h), rope, past_k, past_v, past_len)
        h = h + self._branch(a, self.ls_attn if layerscale else None)
        h = h + self._branch(self.mlp(self.mlp_norm(h)), self.ls_mlp if layerscale else None)
        return h, k, v
