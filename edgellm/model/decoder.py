"""The one decoder: embed -> N blocks -> head, with an explicit, caller-owned KV cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .layers import Block, make_norm
from .rope import Rotary, sinusoidal_table

KV = list[tuple[Tensor, Tensor]]


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, context_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg, context_len) if cfg.rotary else None
        # sliding-window layers (Gemma 3) have their own RoPE table; no module without them (state dicts unchanged)
        windows = [cfg.window(i) for i in range(cfg.n_layers)]
        if any(w is not None for w in windows):
            self.rotary_local = Rotary(cfg, context_len, local=True)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.pos_embedding == "learned":  # GPT-2's wpe: [max_seq_len, D], added to the token embeddings
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim)
        elif cfg.pos_embedding == "sinusoidal":  # seed 004's fixed table, rebuilt (never saved)
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.dim), persistent=False)
        self.layers = nn.ModuleList(Block(cfg, self.rotary if w is None else self.rotary_local, w) for w in windows)
        self.norm = make_norm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), output projections scaled by 1/sqrt(2L)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def set_context_len(self, context_len: int) -> None:
        """Build RoPE for this context (LongRoPE picks long or short factors by it)."""
        if self.rotary is not None:
            self.rotary.set_context_len(context_len)
        if hasattr(self, "rotary_local"):
            self.rotary_local.set_context_len(context_len)

    def position_table(self) -> Tensor | None:
        """[max_seq_len, D] absolute position embeddings added to the token embeddings, or None (RoPE)."""
        if self.cfg.pos_embedding == "learned":
            return self.pos_embed.weight
        return self.pos_table if self.cfg.pos_embedding == "sinusoidal" else None

    def embed_tokens(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens [B,S] int64 -> hidden [B,S,D] (times scale_emb), plus the position table's rows at
        `positions` [B,S] (default 0..S-1) for absolute position embeddings."""
        h = self.embed(tokens)
        if self.cfg.scale_emb != 1.0:
            h = h * self.cfg.scale_emb
        table = self.position_table()
        if table is not None:
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
            h = h + F.embedding(positions, table)
        return F.dropout(h, self.cfg.dropout, self.training)

    def head(self, h: Tensor) -> Tensor:
        """hidden [B,S,D] -> logits [B,S,V]: final norm, width scaling, lm_head (tied or not)."""
        h = self.norm(h)
        if self.cfg.width_scale != 1.0:
            h = h / self.cfg.width_scale
        weight = self.embed.weight if self.cfg.tie_embeddings else self.lm_head.weight
        return F.linear(h, weight)

    def forward(self, tokens: Tensor, positions: Tensor | None = None, past: KV | None = None,
                past_len: Tensor | None = None) -> tuple[Tensor, KV]:
        """tokens [B,S] -> (logits [B,S,V], [(k_new, v_new) [B,KV,S,hd] per layer]).

        `past` holds the static buffers [B,KV,max_seq,hd] of which the first `past_len` [B] rows are filled (a
        sliding-window layer's may be a ring of fewer rows, runtime/kvcache.py);
        without it attention is causal over these S tokens alone (training, or a one-shot forward).
        """
        b, s = tokens.shape
        if past is not None and past_len is None:
            raise ValueError("past_len is required with a past cache")
        if positions is None:
            start = past_len.view(b, 1) if past is not None else 0
            positions = torch.arange(s, device=tokens.device)[None, :] + start
        h = self.embed_tokens(tokens, positions)
        new_kv: KV = []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            h, k, v = layer(h, positions, pk, pv, past_len)
            new_kv.append((k, v))
        return self.head(h), new_kv

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits, _ = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
