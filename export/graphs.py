"""The modules that become ONNX graphs, one per export unit, each with the fixed I/O of design.md.

A unit is what one journal entry covers: a stem ("embed", "layer_3", "head", "model") exported at S =
prefill_chunk and S = 1, both variants pointing into one `<stem>.data`. The wrappers hold only the pieces
of the `Decoder` they need, so tracing never lifts the other layers' weights; verification compares each
graph with the `Decoder`'s own methods (`reference`), not with these wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgellm.model import Decoder
from edgellm.runtime.errors import need
from edgellm.runtime.graphio import Dims, TensorSpec, graph_io, graph_paths
from edgellm.runtime.kvcache import write_ring, write_rows


def _embed_lookup(table: Tensor, tokens: Tensor, tied: bool, scale: float) -> Tensor:
    """tokens [1,S] -> [1,S,D], a row Gather of the [V,D] table. Tied: Gather(E, ids [S], axis=0), the very
    initializer the head's Gemm(h, E, transB=1) reads, so the table is stored once (quant/tied.py finds this
    form). Until 2026-11-26 the table was stored as the head's E^T [D,V] and the lookup gathered a column of
    it: D pages per token, so the whole table stayed resident beside the head's packed copy, and releasing
    it cost 5 % of an fp32 SmolLM2 decode step (docs/design.md)."""
    if tied:
        h = table.index_select(0, tokens.reshape(-1)).unsqueeze(0)
    else:
        h = F.embedding(tokens, table)
    return h * scale if scale != 1.0 else h


class EmbedGraph(nn.Module):
    """tokens [1,S] (+ positions [1,S] with an absolute position table: a row Gather added, GPT-2) -> [1,S,D]."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.embed = model.embed
        self.tied, self.scale = model.cfg.tie_embeddings, model.cfg.scale_emb
        self.pos = model.cfg.pos_embedding
        if self.pos == "learned":
            self.pos_embed = model.pos_embed
        elif self.pos == "sinusoidal":  # the model's fixed table, a constant of the graph
            self.register_buffer("pos_table", model.pos_table, persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        h = _embed_lookup(self.embed.weight, tokens, self.tied, self.scale)
        if self.pos == "rope":
            return h
        table = self.pos_embed.weight if self.pos == "learned" else self.pos_table
        return h + F.embedding(positions, table)


class LayerGraph(nn.Module):
    def __init__(self, model: Decoder, layer: int) -> None:
        super().__init__()
        self.block = model.layers[layer]

    def forward(self, hidden: Tensor, positions: Tensor, past_len: Tensor, past_key: Tensor,
                past_value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.block(hidden, positions, past_key, past_value, past_len)


class HeadGraph(nn.Module):
    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.norm = model.norm
        self.width_scale = model.cfg.width_scale
        self.tied = model.cfg.tie_embeddings
        self.out = model.embed if self.tied else model.lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        h = self.norm(hidden)
        if self.width_scale != 1.0:
            h = h / self.width_scale
        if self.tied:  # [S,D] rows: exported as Gemm(h, E [V,D], transB=1), E shared with the row lookup
            w = self.out.weight
            return F.linear(h.reshape(-1, w.shape[1]), w).reshape(1, -1, w.shape[0])
        return F.linear(h, self.out.weight)  # exported as MatMul(h, W.T) with W.T folded to [D,V]


class ModelGraph(nn.Module):
    """All of it: tokens, positions, past_len, past_key.0, past_value.0, ... -> logits, present_*."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.embed = EmbedGraph(model)
        self.layers = nn.ModuleList(LayerGraph(model, i) for i in range(model.cfg.n_layers))
        self.head = HeadGraph(model)

    def forward(self, tokens: Tensor, positions: Tensor, past_len: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        h = self.embed(tokens, positions)
        present: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            h, k, v = layer(h, positions, past_len, past[2 * i], past[2 * i + 1])
            present += [k, v]
        return (self.head(h), *present)


Reference = Callable[[dict[str, Tensor]], list[Tensor]]


@dataclass(frozen=True)
class Unit:
    """One export unit: its stem, role, layer, the module to trace and the Decoder call it must match."""

    stem: str
    role: str
    layer: int | None
    module: nn.Module
    reference: Reference
    weight_prefixes: tuple[str, ...]  # state-dict names its initializers are named after
    # tensors its data file holds for a later unit's graphs: the head of a tied model with a position table
    # carries that table, so the embedding (token table + position table) reads one data file, head.data
    carried: tuple[Tensor, ...] = ()

    def graph(self, seq: int, dims: Dims) -> tuple[str, str, str, tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """(graph name, .onnx file, data file, inputs, outputs) of the variant with S = seq."""
        name, file, data = graph_paths(self.role, seq, self.layer)
        return (name, file, data, *graph_io(self.role, seq, self.layer, dims))


def plan_units(model: Decoder, granularity: str, kv_layout: str, rings: tuple[bool, ...]) -> list[Unit]:
    """Export order: the head before the embedding, whose tied table points into head.data. `rings`: which layers'
    caches are rings, one entry per layer (graphio `Dims.ring`, the export's one rule)."""
    n = model.cfg.n_layers
    if granularity == "model":
        return [Unit("model", "model", None, ModelGraph(model), _model_ref(model), ("",))]
    head_prefixes = ("norm.", "embed." if model.cfg.tie_embeddings else "lm_head.")
    table = model.position_table()
    carried = (table.detach(),) if model.cfg.tie_embeddings and table is not None else ()
    units = [Unit("head", "head", None, HeadGraph(model), lambda x: [model.head(x["hidden"])], head_prefixes,
                  carried),
             Unit("embed", "embed", None, EmbedGraph(model),
                  lambda x: [model.embed_tokens(x["tokens"], x.get("positions"))], ("embed.", "pos_embed.", "pos_table"))]
    need(len(rings) == n, f"internal: {len(rings)} ring flags for {n} layers")
    units += [Unit(f"layer_{i}", "layer", i, LayerGraph(model, i), _layer_ref(model, i, kv_layout, rings[i]),
                   (f"layers.{i}.", "rotary.", "rotary_local."))
              for i in range(n)]
    return units


def _layer_ref(model: Decoder, i: int, kv_layout: str, ring: bool) -> Reference:
    def ref(x: dict[str, Tensor]) -> list[Tensor]:
        if kv_layout == "rows":
            return list(model.layers[i](x["hidden"], x["positions"], x[f"past_key.{i}"], x[f"past_value.{i}"],
                                        x["past_len"]))
        # inplace: the expected present_* is the past cache with the new rows written by the one rule; with
        # zero-padded heads (cache rows wider than hd) the model reads the first hd entries of each row and its
        # new rows are written padded with zeros
        s, hd = x["hidden"].shape[1], model.cfg.hd
        start = int(x["total_len"]) - s
        past_k, past_v = x[f"past_key.{i}"], x[f"past_value.{i}"]
        h, k, v = model.layers[i](x["hidden"], (torch.arange(s) + start)[None, :], past_k[..., :hd],
                                  past_v[..., :hd], torch.tensor([start]))
        pad = (0, past_k.shape[-1] - hd)
        caches = [past_k.numpy().copy(), past_v.numpy().copy()]
        # a sliding layer whose window covers the cache (format 16) is a full one: its rows past the filled length
        # are masked by the model's ring formula as never written, so the model reads it as it reads a ring
        write = write_ring if ring else write_rows  # a ring of max_seq rows is linear
        write(caches[0], F.pad(k, pad).numpy(), start, s)
        write(caches[1], F.pad(v, pad).numpy(), start, s)
        if not ring:  # fused attention's zero row lands in the row after them (graphio.SPARE_ROWS)
            for cache in caches:
                cache[:, :, start + s] = 0
        return [h, *(torch.from_numpy(c) for c in caches)]
    return ref


def _model_ref(model: Decoder) -> Reference:
    def ref(x: dict[str, Tensor]) -> list[Tensor]:
        past = [(x[f"past_key.{i}"], x[f"past_value.{i}"]) for i in range(model.cfg.n_layers)]
        logits, new_kv = model(x["tokens"], x["positions"], past, x["past_len"])
        return [logits, *(t for kv in new_kv for t in kv)]
    return ref


def example_inputs(inputs: tuple[TensorSpec, ...], dims: Dims, gen: torch.Generator,
                   past_len: int) -> dict[str, Tensor]:
    """Seeded inputs: random tokens, N(0,1) hidden and a random full cache of which `past_len` rows count."""
    out: dict[str, Tensor] = {}
    for spec in inputs:
        if spec.name == "tokens":
            out[spec.name] = torch.randint(0, dims.vocab_size, spec.shape, generator=gen)
        elif spec.name == "positions":
            out[spec.name] = (torch.arange(spec.shape[1]) + past_len)[None, :]
        elif spec.name == "past_len":
            out[spec.name] = torch.tensor([past_len])
        elif spec.name == "seqlens_k":  # inplace layers: S = the hidden input's length
            out[spec.name] = torch.tensor([past_len + inputs[0].shape[1] - 1], dtype=torch.int32)
        elif spec.name == "total_len":
            out[spec.name] = torch.tensor(past_len + inputs[0].shape[1], dtype=torch.int32)
        elif spec.dtype == "float16":  # an fp16 cache (kv_dtype): values it can hold, so the reference reads them
            out[spec.name] = torch.randn(spec.shape, generator=gen).half().float()
        else:
            out[spec.name] = torch.randn(spec.shape, generator=gen)
    return out
