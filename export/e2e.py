"""End-to-end check: the runtime's `Engine` feeds a prompt (chunked prefill) then decode steps, against the
Decoder's full forward (no cache) on the same tokens.

The prompt length is not a multiple of the chunk, so the last chunk is padded and only its real rows are
written. `Engine.forward_rows` returns every row's logits, so each prompt position is checked too. The Engine
holds the export's graphs as the runtime does (~1x the weights; the stack check after it runs the whole model
as well); the PyTorch side holds one part at a time and is done before the Engine opens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from edgellm.loaders.lazy import Weights
from edgellm.runtime.engine import Engine
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.session import SessionConfig

from .memory import release_memory
from .verify import max_abs_diff


def e2e_lengths(max_seq: int, chunk: int) -> tuple[int, int]:
    """(prompt length, decode steps): a prompt of 1.5 chunks + 1 (never a multiple), then 4 steps."""
    steps = min(4, max_seq // 2)
    prompt = max(1, min(chunk + chunk // 2 + 1, max_seq - steps))
    return prompt, steps


def onnx_logits(directory: Path, manifest: Manifest, tokens: np.ndarray, prompt: int) -> np.ndarray:
    """Logits [T, V] for `tokens` [T]: the first `prompt` as one prompt, the rest one at a time, through the stack
    greedy runs decode with (its spare attention row; the lone-row stack is checked against it: stacking.check_lone)."""
    engine = Engine.open(directory, manifest, SessionConfig(exact=True))
    rows = [engine.forward_rows(tokens[:prompt])]
    rows += [engine.forward_rows(tokens[t:t + 1]) for t in range(prompt, len(tokens))]
    return np.concatenate(rows)


def forward_by_parts(parts: Weights, tokens: Tensor) -> Tensor:
    """The Decoder's full forward (no cache) of `tokens` [B,S] -> logits [B,S,V], the same calls in the same
    order as `Decoder.forward`, holding one part's parameters at a time (the embedding, each layer, the head)."""
    model = parts.model
    positions = torch.arange(tokens.shape[1])[None, :]
    with torch.no_grad():
        with parts.holding(("embed.",)):
            h = model.embed_tokens(tokens)
        for i, layer in enumerate(model.layers):
            with parts.holding((f"layers.{i}.",)):
                h, _, _ = layer(h, positions, None, None, None)
        with parts.holding(("norm.", "embed." if model.cfg.tie_embeddings else "lm_head.")):
            return model.head(h)


def check_end_to_end(parts: Weights, directory: Path, manifest: Manifest, seed: int) -> float:
    """Max |logits| difference over every prompt and decode position."""
    prompt, steps = e2e_lengths(manifest.max_seq, manifest.prefill_chunk)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, manifest.vocab_size, (prompt + steps,), generator=gen)
    want = forward_by_parts(parts, tokens[None])[0].numpy()
    n_params = parts.model.cfg.n_params()
    release_memory(n_params)
    got = onnx_logits(directory, manifest, tokens.numpy(), prompt)
    release_memory(n_params)
    return max_abs_diff([got], [want])
