"""An independent numpy forward of every preset, written from the seed formulas (not from edgellm.model).

Deliberately naive: explicit loops over heads, kv heads repeated, RoPE from the angle formula pair by pair.
"""

from __future__ import annotations

import math

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, mode: str) -> np.ndarray:
    ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True)
    inv = 1.0 / np.sqrt(np.maximum(ms, eps) if mode == "clamp" else ms + eps)
    return x * inv * w


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def norm(x: np.ndarray, sd: dict, name: str, cfg: dict) -> np.ndarray:
    if cfg["norm_kind"] == "layer":
        return layernorm(x, sd[name + ".weight"], sd[name + ".bias"], cfg["norm_eps"])
    return rmsnorm(x, sd[name + ".weight"], cfg["norm_eps"], cfg["norm_eps_mode"])


def gelu(x: np.ndarray, tanh: bool) -> np.ndarray:
    """GELU: x * Phi(x) (erf), or GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def sinusoid(pos: int, d: int) -> np.ndarray:
    """Seed 004: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pe = np.zeros(d)
    for j in range(0, d, 2):
        pe[j] = math.sin(pos / 10000 ** (j / d))
        pe[j + 1] = math.cos(pos / 10000 ** (j / d))
    return pe


def rope_pairs(hd: int, style: str) -> list[tuple[int, int]]:
    """Index pairs rotated together by frequency i: (i, i + hd/2) rotate-half, (2i, 2i+1) interleaved."""
    half = hd // 2
    return [(i, i + half) if style == "half" else (2 * i, 2 * i + 1) for i in range(half)]


def rope(x: np.ndarray, pos: int, cfg: dict, context_len: int, sign: int) -> np.ndarray:
    """x [hd] at position pos. sign=+1 for queries, -1 for keys (XPos scale vs 1/scale)."""
    hd = x.shape[-1]
    out = np.empty_like(x)
    mscale = 1.0
    if cfg["rope_long_factor"] is not None:
        s = cfg["max_seq_len"] / cfg["rope_original_max"]
        mscale = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(cfg["rope_original_max"]))
        use_long = context_len > cfg["rope_original_max"]
        factors = cfg["rope_long_factor"] if use_long else cfg["rope_short_factor"]
    for i, (a, b) in enumerate(rope_pairs(hd, cfg["rope_style"])):
        freq = cfg["rope_theta"] ** (-2 * i / hd)
        if cfg["rope_long_factor"] is not None:
            freq /= factors[i]
        scale = 1.0
        if cfg["xpos"]:
            center = cfg["max_seq_len"] // 2 if cfg["xpos_center"] is None else cfg["xpos_center"]
            scale = ((2 * i / hd + 0.4) / 1.4) ** ((pos - center) / cfg["xpos_scale_base"])
            scale = scale if sign > 0 else 1.0 / scale
        xa, xb = x[a] * scale, x[b] * scale
        c, s_ = math.cos(pos * freq) * mscale, math.sin(pos * freq) * mscale
        out[a] = xa * c - xb * s_
        out[b] = xb * c + xa * s_
    return out


def forward(sd: dict[str, np.ndarray], cfg: dict, tokens: list[int], context_len: int | None = None) -> np.ndarray:
    """Logits [S, V] of one sequence, no cache (float64)."""
    context_len = context_len or cfg["max_seq_len"]
    d, hn, kvn = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = cfg["head_dim"] or d // hn
    eps, mode = cfg["norm_eps"], cfg["norm_eps_mode"]
    depth = 1.0 if cfg["scale_depth"] is None else cfg["scale_depth"] / math.sqrt(cfg["n_layers"])
    x = sd["embed.weight"][tokens].astype(np.float64) * cfg["scale_emb"]
    n = len(tokens)
    pos_kind = cfg.get("pos_embedding", "rope")
    if pos_kind == "learned":
        x = x + sd["pos_embed.weight"][:n]
    elif pos_kind == "sinusoidal":
        x = x + np.stack([sinusoid(t, d) for t in range(n)])
    bias = cfg.get("linear_bias", False)

    def linear(h: np.ndarray, name: str) -> np.ndarray:
        y = h @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y
    for layer in range(cfg["n_layers"]):
        p = f"layers.{layer}."
        h = norm(x, sd, p + "attn_norm", cfg)
        qkv = h @ sd[p + "attn.qkv.weight"].T
        if cfg["qkv_bias"] or bias:
            qkv = qkv + sd[p + "attn.qkv.bias"]
        q = qkv[:, : hn * hd].reshape(n, hn, hd)
        k = qkv[:, hn * hd: (hn + kvn) * hd].reshape(n, kvn, hd)
        v = qkv[:, (hn + kvn) * hd:].reshape(n, kvn, hd)
        if cfg["qk_norm"]:
            q = rmsnorm(q, sd[p + "attn.q_norm.weight"], eps, mode)
            k = rmsnorm(k, sd[p + "attn.k_norm.weight"], eps, mode)
        out = np.zeros((n, hn, hd))
        for head in range(hn):
            kvh = head // (hn // kvn)
            if pos_kind == "rope":
                qs = np.stack([rope(q[t, head], t, cfg, context_len, +1) for t in range(n)])
                ks = np.stack([rope(k[t, kvh], t, cfg, context_len, -1) for t in range(n)])
            else:
                qs, ks = q[:, head], k[:, kvh]
            att = qs @ ks.T / math.sqrt(hd)
            att = np.where(np.tril(np.ones((n, n), bool)), att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            out[:, head] = (att / att.sum(-1, keepdims=True)) @ v[:, kvh]
        a = linear(out.reshape(n, hn * hd), p + "attn.o")
        if cfg["layerscale_init"] is not None:
            a = a * sd[p + "ls_attn"]
        x = x + a * depth
        h = norm(x, sd, p + "mlp_norm", cfg)
        if cfg.get("mlp_kind", "swiglu") == "swiglu":
            gate, up = np.split(linear(h, p + "mlp.gate_up"), 2, axis=-1)
            m = linear(gate / (1 + np.exp(-gate)) * up, p + "mlp.down")
        else:
            m = linear(gelu(linear(h, p + "mlp.up"), cfg["mlp_kind"] == "gelu_tanh"), p + "mlp.down")
        if cfg["layerscale_init"] is not None:
            m = m * sd[p + "ls_mlp"]
        x = x + m * depth
    x = norm(x, sd, "norm", cfg)
    if cfg["dim_model_base"] is not None:
        x = x / (d / cfg["dim_model_base"])
    head = sd["embed.weight"] if cfg["tie_embeddings"] else sd["lm_head.weight"]
    return x @ head.T
