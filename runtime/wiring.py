"""Which buffers each graph of an Engine's Variant reads and writes (`Engine._build`, `few_rows`): one model
graph, the embed graph and one graph per layer, or the stack graph. Every graph is opened, bound and appended
to the Variant through the Engine's `Bind` (its session placement and sharing are the Engine's); the inputs that
every graph of a step reads (`Lengths`) are the Engine's own buffers, written in place before each run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .kvcache import KVCache
from .manifest import Manifest
from .variant import Variant

# (variant, role, seq, layer, inputs, outputs, spec_seq): open (or share) that graph's session, bind the buffers
Bind = Callable[[Variant, str, int, int | None, dict[str, np.ndarray], dict[str, np.ndarray], int | None], None]


@dataclass(frozen=True)
class Lengths:
    """The cache-length inputs of a step's graphs (one buffer each, shared by every graph and variant)."""

    past_len: np.ndarray   # [1] int64: rows already cached (kv_layout "rows")
    seqlens_k: np.ndarray  # [1] int32: GroupQueryAttention's last row index (kv_layout "inplace")
    total_len: np.ndarray  # [] int32: GroupQueryAttention's rows after this call


def embed_positions(v: Variant, m: Manifest) -> dict[str, np.ndarray]:
    """The embedding's `positions` input, for models with an absolute position table (format 8)."""
    return {"positions": v.positions} if m.dims.embed_positions else {}


def wire_model(v: Variant, m: Manifest, cache: KVCache, lengths: Lengths, bind: Bind) -> None:
    """Model granularity: one graph, logits for every row, present rows copied into the cache after the run."""
    v.add_present(m.n_layers, m)
    v.logits = np.zeros((1, v.seq, m.vocab_size), np.float32)
    inputs = {"tokens": v.tokens, "positions": v.positions, "past_len": lengths.past_len}
    outputs = {"logits": v.logits}
    for i in range(m.n_layers):
        inputs[f"past_key.{i}"], inputs[f"past_value.{i}"] = cache.keys[i], cache.values[i]
        outputs[f"present_key.{i}"], outputs[f"present_value.{i}"] = v.keys[i], v.values[i]
    bind(v, "model", v.seq, None, inputs, outputs, None)


def wire_layers(v: Variant, m: Manifest, cache: KVCache, in_place: bool, lengths: Lengths, bind: Bind) -> None:
    """embed -> layer_0 .. layer_{N-1}, one session each; "inplace" layers write the cache buffers themselves."""
    seq = v.seq
    if not in_place:
        v.add_present(m.n_layers, m)
    # hidden states ping-pong between two [1, S, D] buffers: a graph never reads the buffer it writes
    hidden = [np.zeros((1, seq, m.dim), np.float32) for _ in range(2)]
    bind(v, "embed", seq, None, {"tokens": v.tokens, **embed_positions(v, m)}, {"hidden": hidden[0]}, None)
    if in_place:
        common = {"seqlens_k": lengths.seqlens_k, "total_len": lengths.total_len}
    else:
        common = {"positions": v.positions, "past_len": lengths.past_len}
    for i in range(m.n_layers):
        inputs = {"hidden": hidden[i % 2], **common, f"past_key.{i}": cache.keys[i], f"past_value.{i}": cache.values[i]}
        present = (cache.keys[i], cache.values[i]) if in_place else (v.keys[i], v.values[i])
        outputs = {"hidden_out": hidden[(i + 1) % 2], f"present_key.{i}": present[0], f"present_value.{i}": present[1]}
        bind(v, "layer", seq, i, inputs, outputs, None)
    v.hidden_out = hidden[m.n_layers % 2]


def wire_stack(v: Variant, m: Manifest, cache: KVCache, role: str, lengths: Lengths, bind: Bind,
               spec_seq: int | None = None) -> None:
    """The stack graph of `role` ("stack" / "stack_lone"): embedding and every layer in one session, writing every
    cache in place. `spec_seq`: the manifest variant whose paired session runs this S (few_rows)."""
    v.hidden_out = np.zeros((1, v.seq, m.dim), np.float32)
    inputs = {"tokens": v.tokens, **embed_positions(v, m), "seqlens_k": lengths.seqlens_k,
              "total_len": lengths.total_len}
    outputs = {"hidden_out": v.hidden_out}
    for i in range(m.n_layers):
        inputs[f"past_key.{i}"] = outputs[f"present_key.{i}"] = cache.keys[i]
        inputs[f"past_value.{i}"] = outputs[f"present_value.{i}"] = cache.values[i]
    bind(v, role, v.seq, None, inputs, outputs, spec_seq)
