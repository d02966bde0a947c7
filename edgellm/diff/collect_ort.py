"""The export side of a diff: the runtime's `Engine` over the export's graphs, one hook watching each graph.

A layer-granularity export runs graph by graph (embed -> layer_0..L-1 -> head; never the stack graph), so the
hidden state after every layer (`hidden_out`) is observed, and the K/V rows each layer wrote are read back from
the cache. A model-granularity export has only `logits` and `present_*.{i}` as outputs: its K/V rows are
compared per layer, its hidden states are not observable. An int8 cache's rows are read back as the kernel reads
them, code * scale (the per-channel scales in each layer graph, quant/kv_int8.py).
The teacher-forced pass is `Engine.forward_rows`: the runtime's own graph calls (`kvcache.plan_calls`:
prefill chunks padded with token 0, padded rows never written to the cache), sessions, options and shared
weight maps, so the numbers are those of what the board runs. Greedy continuations come from the runtime
`Generator` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgellm.quant.kv_int8 import SCALE_NAMES
from edgellm.runtime.engine import Engine, GraphRun
from edgellm.runtime.generator import Generator
from edgellm.runtime.kvcache import plan_calls
from edgellm.runtime.manifest import Manifest
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig

from .trace import Trace, join_rows


def open_engine(directory: Path, manifest: Manifest, threads: int | None = None) -> Engine:
    """The runtime's Engine on the layer graphs (not the stack: its layers' outputs are not observable)."""
    return Engine.open(Path(directory), manifest, SessionConfig(threads=threads, stack=False))


def export_trace(engine: Engine, tokens: list[int]) -> Trace:
    """Teacher-forced pass over `tokens` from an empty cache, in the runtime's chunks (the reference's plan)."""
    m, cache = engine.manifest, engine.cache
    layered = m.granularity == "layer"
    embed: list[np.ndarray] = []
    hidden: list[list[np.ndarray]] = [[] for _ in range(m.n_layers)]
    keys: list[list[np.ndarray]] = [[] for _ in range(m.n_layers)]
    values: list[list[np.ndarray]] = [[] for _ in range(m.n_layers)]

    def watch(run: GraphRun) -> None:
        if run.spec.role == "embed":
            embed.append(run.outputs["hidden"][0, :run.count].copy())
        elif run.spec.role == "layer":
            hidden[run.spec.layer].append(run.outputs["hidden_out"][0, :run.count].copy())

    scales = stored_cache_scales(engine.directory, m) if m.kv_dtype == "int8" else None
    cache.reset()
    logits = []
    for s, c, _ in plan_calls(len(tokens), m.prefill_chunk, 0, m.max_seq, m.kv_layout):
        logits.append(engine.forward_rows(tokens[s:s + c], watch))  # one graph call: the same plan
        rows = np.arange(s, s + c)
        for i in range(m.n_layers):  # the rows as they landed in the cache: [n_kv, c, hd] (zero padding dropped)
            slots = rows % cache.keys[i].shape[2]  # a ring's slots (linear: the rows)
            k, v = cache.keys[i][0][:, slots, :m.model_head_dim], cache.values[i][0][:, slots, :m.model_head_dim]
            if scales is not None:  # [n_kv, c, hd] codes x [n_kv, 1, hd] scales
                k, v = (x * sc[..., :m.model_head_dim] for x, sc in zip((k, v), scales[i], strict=True))
            keys[i].append(k)
            values[i].append(v)
    return Trace(
        logits=join_rows(logits, 0),
        embed=join_rows(embed, 0) if layered else None,
        hidden=[join_rows(rows, 0) for rows in hidden] if layered else None,
        keys=[join_rows(rows, 1) for rows in keys],
        values=[join_rows(rows, 1) for rows in values],
    )


def stored_cache_scales(directory: Path, m: Manifest) -> list[tuple[np.ndarray, np.ndarray]]:
    """An int8 cache's (k, v) scales [n_kv, 1, hd] per layer, read from its layer graphs (external data or not)."""
    out = []
    for i in range(m.n_layers):
        path = Path(directory) / m.graph("layer", 1, i).file
        inits = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
        out.append(tuple(numpy_helper.to_array(inits[f"layers.{i}.attn.{n}"], str(path.parent)) for n in SCALE_NAMES))
    return out


def export_greedy(directory: Path, prompts: list[list[int]], max_new: int, threads: int | None,
                  on_done: Callable[[], None]) -> list[list[int]]:
    """Greedy continuations from the runtime `Generator` (what `edgellm run --temperature 0` does).

    The Generator leaves EOS out of its tokens; it is put back here so both sides follow `torch_greedy`'s
    convention (EOS is the last token of a continuation that stopped on it).
    """
    # the manifest was checked by the caller; the spare-row stack, as a greedy `edgellm run` opens it
    gen = Generator.open(directory, threads, config=SessionConfig(exact=True), verify=False)
    runs = []
    for prompt in prompts:
        result = gen.complete(prompt, SamplingParams(temperature=0.0), StopParams(max_new_tokens=max_new, seed=0))
        runs.append(list(result.token_ids) + ([gen.eos_id] if result.finish_reason == "eos" else []))
        on_done()
    return runs
