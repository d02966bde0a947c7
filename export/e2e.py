"""End-to-end check: chunked prefill + decode steps through onnxruntime with the runtime's KVCache rule,
against the Decoder's full forward (no cache) on the same tokens.

The prompt length is not a multiple of the chunk, so the last chunk is padded and only its real rows are
written. The tokens are fixed (teacher forcing), so the graphs can be run graph-major: every call (prefill
chunks, then one decode step per token) through the embedding, then all of them through layer 0, ... Each
layer sees exactly the inputs and cache it would see token-major, and only one graph is ever loaded in
onnxruntime, so a large model is not held twice next to its PyTorch copy.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from edgellm.loaders.lazy import Weights
from edgellm.runtime.graphio import Dims, graph_paths
from edgellm.runtime.kvcache import KVCache, embed_feeds, plan_calls, step_feeds

from .verify import max_abs_diff, session


class OneSession:
    """Runs graphs by (stem, seq), keeping at most one onnxruntime session loaded."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key: tuple[str, int] | None = None
        self.sess: ort.InferenceSession | None = None

    def run(self, stem: str, seq: int, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.key != (stem, seq):
            self.sess = None  # freed here (refcount), before the next graph's weights load
            role, _, layer = stem.partition("_")
            self.sess = session(self.directory / graph_paths(role, seq, int(layer) if layer else None)[1])
            self.key = (stem, seq)
        return self.sess.run(None, feeds)


def e2e_lengths(max_seq: int, chunk: int) -> tuple[int, int]:
    """(prompt length, decode steps): a prompt of 1.5 chunks + 1 (never a multiple), then 4 steps."""
    steps = min(4, max_seq // 2)
    prompt = max(1, min(chunk + chunk // 2 + 1, max_seq - steps))
    return prompt, steps


def onnx_logits(directory: Path, granularity: str, dims: Dims, chunk: int, tokens: np.ndarray,
                prompt: int) -> np.ndarray:
    """Logits [T, V] for `tokens` [T]: the first `prompt` in chunks of `chunk`, the rest one at a time."""
    # calls: (first token, real tokens, graph S), the runtime's plan: the last prefill chunk padded with token 0
    calls = plan_calls(prompt, chunk, 0, dims.max_seq, dims.kv_layout)
    calls += [(t, 1, 1) for t in range(prompt, len(tokens))]
    ids = []
    for start, count, seq in calls:
        chunk_ids = np.zeros((1, seq), np.int64)
        chunk_ids[0, :count] = tokens[start:start + count]
        ids.append(chunk_ids)
    runner = OneSession(directory)
    cache = KVCache(dims.n_layers, dims.n_kv_heads, dims.max_seq, dims.head_dim, rows=dims.rows)
    layout = dims.kv_layout
    if granularity == "model":
        logits = []
        for (start, count, seq), x in zip(calls, ids, strict=True):
            feeds = {"tokens": x, **step_feeds(layout, start, seq, dims.max_seq)}
            for i in range(dims.n_layers):
                feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache.keys[i], cache.values[i]
            out, *present = runner.run("model", seq, feeds)
            for i in range(dims.n_layers):
                cache.write(i, present[2 * i], present[2 * i + 1], count)
            cache.advance(count)
            logits.append(out[0, :count])
        return np.concatenate(logits)
    hidden = [runner.run("embed", seq, {"tokens": x, **embed_feeds(dims.embed_positions, start, seq, dims.max_seq)})[0]
              for (start, _, seq), x in zip(calls, ids, strict=True)]
    for i in range(dims.n_layers):
        cache.reset()  # this layer's pass walks the context from 0 again; its own buffers are fresh
        for c, (start, count, seq) in enumerate(calls):
            hidden[c], k, v = runner.run(f"layer_{i}", seq, {
                "hidden": hidden[c], **step_feeds(layout, start, seq, dims.max_seq),
                f"past_key.{i}": cache.keys[i], f"past_value.{i}": cache.values[i]})
            cache.write_present(i, layout, k, v, count)
            cache.advance(count)
    return np.concatenate([runner.run("head", seq, {"hidden": h})[0][0, :count]
                           for (_, count, seq), h in zip(calls, hidden, strict=True)])


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


def check_end_to_end(parts: Weights, directory: Path, granularity: str, dims: Dims, chunk: int,
                     seed: int) -> float:
    """Max |logits| difference over every prompt and decode position."""
    prompt, steps = e2e_lengths(dims.max_seq, chunk)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, dims.vocab_size, (prompt + steps,), generator=gen)
    want = forward_by_parts(parts, tokens[None])[0].numpy()
    got = onnx_logits(directory, granularity, dims, chunk, tokens.numpy(), prompt)
    gc.collect()
    return max_abs_diff([got], [want])
