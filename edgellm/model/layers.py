"""The decoder's building blocks: RMSNorm / LayerNorm, attention over a static KV cache, SwiGLU / GELU MLP, the
block."""

from __future__ import annotations

from functools import partial

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

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        hd, h, kv = cfg.hd, cfg.n_heads, cfg.n_kv_heads
        self.qkv = nn.Linear(cfg.dim, (h + 2 * kv) * hd, bias=cfg.qkv_biased)
        self.o = nn.Linear(h * hd, cfg.dim, bias=cfg.linear_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_eps_mode)

    def _past_mask(self, m: int, past_len: Tensor, qpos: Tensor, g: int) -> Tensor:
        """Which of the M cached rows each query row sees: [B,1,G*S,M] (or [B,1,1,M] for full attention).

        Full attention: rows [0, past_len). A sliding layer's cache is a ring (runtime/kvcache.py: position p
        lives in row p % M, M = its rows): row r holds p_r = L-1 - ((L-1-r) mod M), L = past_len (the newest
        position with that residue; M >= L gives p_r = r), valid when p_r >= 0 and q_pos - p_r < window.
        Keys are cached after RoPE, so their order in the ring does not matter to the softmax."""
        b = past_len.shape[0]
        rows = torch.arange(m, device=past_len.device)[None, :]  # [1,M]
        last = past_len.view(b, 1) - 1
        if self.window is None:
            return (rows <= last)[:, None, None, :]
        pos = last - torch.remainder(last - rows + m, m)  # [B,M]; the + m keeps the dividend >= 0
        near = qpos.repeat(1, g)[:, :, None] - pos[:, None, :] < self.window  # [B,G*S,M]
        return ((pos >= 0)[:, None, :] & near)[:, None]

    def forward(self, x: Tensor, rope: tuple | None, past_k: Tensor | None, past_v: Tensor | None,
                past_len: Tensor | None, qpos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,S,D]; `qpos` [B,S]: the query positions (a sliding layer's cache mask needs them)."""
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

        qg = q.reshape(b, kv, g * s, hd) * cfg.scale  # head h = kv_head * G + group
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()  # [S, S]
        if self.window is not None:  # and q_pos - k_pos < window
            causal = causal.triu(1 - self.window)
        scores = (qg @ k.transpose(-1, -2)).masked_fill(~causal.repeat(g, 1), float("-inf"))  # [B,KV,G*S,S]
        if past_k is None:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32)
            probs = F.dropout(probs, cfg.dropout, self.training)
            out = probs @ v
        else:
            m = past_k.shape[2]
            past_scores = (qg @ past_k.transpose(-1, -2)).masked_fill(~self._past_mask(m, past_len, qpos, g),
                                                                      float("-inf"))
            probs = F.softmax(torch.cat((past_scores, scores), dim=-1), dim=-1, dtype=torch.float32)
            out = probs[..., :m] @ past_v + probs[..., m:] @ v  # [B,KV,G*S,hd]
        out = out.view(b, kv, g, s, hd).reshape(b, h, s, hd).transpose(1, 2).reshape(b, s, h * hd)
        return self.o(out), k, v


class MLP(nn.Module):
    """SwiGLU (or GeGLU, glu_act "gelu_tanh"): down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = F.silu if cfg.glu_act == "silu" else partial(F.gelu, approximate="tanh")
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=cfg.linear_bias)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


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
    """Pre-norm block: h += branch(attn); h += branch(mlp); a branch is LayerScale, depth scaling, DropPath,
    and with `post_norms` (Gemma) a norm of the branch output first."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None, window: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary  # shared by the blocks of a kind; a layer graph computes its RoPE from positions; None: no RoPE
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, window)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg) if cfg.mlp_kind == "swiglu" else GeluMLP(cfg)
        if cfg.post_norms:
            self.attn_post_norm = make_norm(cfg)
            self.mlp_post_norm = make_norm(cfg)
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
        layerscale, post = self.cfg.layerscale_init is not None, self.cfg.post_norms
        rope = self.rotary(positions) if self.rotary is not None else None
        a, k, v = self.attn(self.attn_norm(h), rope, past_k, past_v, past_len, positions)
        h = h + self._branch(self.attn_post_norm(a) if post else a, self.ls_attn if layerscale else None)
        m = self.mlp(self.mlp_norm(h))
        h = h + self._branch(self.mlp_post_norm(m) if post else m, self.ls_mlp if layerscale else None)
        return h, k, v
