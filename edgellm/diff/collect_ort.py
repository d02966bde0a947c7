"""The export side of a diff: its graphs run one by one in onnxruntime, through the runtime's KVCache.

A layer-granularity export is driven graph by graph (embed -> layer_0..L-1 -> head), so the hidden state
after every layer (`hidden_out`) and the K/V rows it writes (`present_*`) are observed. A model-granularity
export has only `logits` and `present_*.{i}` as outputs: its K/V rows are compared per layer, its hidden
states are not observable.
The teacher-forced pass runs every chunk through the prefill graphs (S = prefill_chunk), padded like the
runtime's engine does it (token 0, positions clamped to max_seq - 1, padded rows never written to the cache),
and keeps every real row of every output. Sessions use the runtime's options and shared weight maps, so the
numbers are those of what the board runs. Greedy continuations come from the runtime `Generator` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import safe_join
from edgellm.runtime.generator import Generator
from edgellm.runtime.kvcache import KVCache, embed_feeds, plan_calls, step_feeds
from edgellm.runtime.manifest import GraphSpec, Manifest
from edgellm.runtime.placement import Placement, plan
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig, SharedWeights, open_placed

from .trace import Trace, join_rows


class ExportRunner:
    """onnxruntime sessions over one export's graphs (opened on first use) and a step function."""

    def __init__(self, directory: Path, manifest: Manifest, threads: int | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = manifest
        self.config = SessionConfig(threads=threads)  # threads None: onnxruntime's default (all cores)
        self._weights = SharedWeights(self.directory)
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._placement: dict[str, Placement] | None = None

    def close(self) -> None:
        """Drop the sessions and weight maps (before the Generator opens its own)."""
        self._sessions.clear()
        self._weights.close()

    def new_cache(self) -> KVCache:
        m = self.manifest
        return KVCache(m.n_layers, m.n_kv_heads, m.max_seq, m.head_dim, rows=m.dims.rows)

    def _session(self, spec: GraphSpec) -> ort.InferenceSession:
        """The runtime's session options (what the board runs), one map of each weight file for all; both
        variants of a paired graph share one session, as in the runtime."""
        key = spec.file if spec.paired else spec.name
        if key not in self._sessions:
            path = safe_join(self.directory, spec.file)
            if self._placement is None:  # placed exactly as the runtime places them
                self._placement = plan(self.directory, self.manifest, self.config.prepack_prefill, stacked=False)
            self._sessions[key] = open_placed(path, spec, self._placement[spec.name], self.config, self._weights)
        return self._sessions[key]

    def _run(self, role: str, seq: int, layer: int | None, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.manifest.graph(role, seq, layer)
        names = [t.name for t in spec.outputs]
        return dict(zip(names, self._session(spec).run(names, feeds), strict=True))

    def step(self, cache: KVCache, ids: list[int], seq: int, capture: dict[str, list] | None = None) -> np.ndarray:
        """Run `ids` through the S = `seq` graphs at the cache's length, padded to S (one call of
        `kvcache.plan_calls`); write their K/V rows, return logits [len(ids), V]. `capture` collects per-layer
        rows when given."""
        m = self.manifest
        count = len(ids)
        if count > seq:
            raise EdgeError(f"internal: chunk of {count} tokens exceeds the graph's S={seq}")
        tokens = np.zeros((1, seq), np.int64)
        tokens[0, :count] = ids  # padding: token 0, computed but never written to the cache
        start = cache.length
        position = step_feeds(m.kv_layout, start, seq, m.max_seq)
        if m.granularity == "model":
            feeds = {"tokens": tokens, **position}
            for i in range(m.n_layers):
                feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache.keys[i], cache.values[i]
            out = self._run("model", seq, None, feeds)
            for i in range(m.n_layers):
                self._write(cache, i, out, count, capture)
            logits = out["logits"]
        else:
            hidden = self._run("embed", seq, None, {
                "tokens": tokens, **embed_feeds(m.dims.embed_positions, start, seq, m.max_seq)})["hidden"]
            if capture is not None:
                capture["embed"].append(hidden[0, :count].copy())
            for i in range(m.n_layers):
                out = self._run("layer", seq, i, {"hidden": hidden, **position,
                                                  f"past_key.{i}": cache.keys[i], f"past_value.{i}": cache.values[i]})
                hidden = out["hidden_out"]
                self._write(cache, i, out, count, capture)
                if capture is not None:
                    capture["hidden"][i].append(hidden[0, :count].copy())
            logits = self._run("head", seq, None, {"hidden": hidden})["logits"]
        cache.advance(count)
        return logits[0, :count]

    def _write(self, cache: KVCache, i: int, out: dict[str, np.ndarray], count: int,
               capture: dict[str, list] | None) -> None:
        start = cache.length
        cache.write_present(i, self.manifest.kv_layout, out[f"present_key.{i}"], out[f"present_value.{i}"], count)
        if capture is not None:  # the rows as they landed in the cache: [n_kv, count, hd] (zero padding dropped)
            hd = self.manifest.model_head_dim
            rows = np.arange(start, start + count) % cache.keys[i].shape[2]  # a ring's slots (linear: the rows)
            capture["keys"][i].append(cache.keys[i][0][:, rows, :hd])  # [n_kv, count, hd]
            capture["values"][i].append(cache.values[i][0][:, rows, :hd])


def export_trace(runner: ExportRunner, tokens: list[int]) -> Trace:
    """Teacher-forced pass over `tokens` in the export's prefill chunks (the same plan as the reference)."""
    m = runner.manifest
    layered = m.granularity == "layer"
    capture: dict[str, list] = {"embed": [], "hidden": [[] for _ in range(m.n_layers)],
                                "keys": [[] for _ in range(m.n_layers)], "values": [[] for _ in range(m.n_layers)]}
    cache = runner.new_cache()
    calls = plan_calls(len(tokens), m.prefill_chunk, 0, m.max_seq, m.kv_layout)
    logits = [runner.step(cache, tokens[s:s + c], seq, capture) for s, c, seq in calls]
    return Trace(
        logits=join_rows(logits, 0),
        embed=join_rows(capture["embed"], 0) if layered else None,
        hidden=[join_rows(rows, 0) for rows in capture["hidden"]] if layered else None,
        keys=[join_rows(rows, 1) for rows in capture["keys"]],
        values=[join_rows(rows, 1) for rows in capture["values"]],
    )


def export_greedy(directory: Path, prompts: list[list[int]], max_new: int, threads: int | None,
                  on_done: Callable[[], None]) -> list[list[int]]:
    """Greedy continuations from the runtime `Generator` (what `edgellm run --temperature 0` does).

    The Generator leaves EOS out of its tokens; it is put back here so both sides follow `torch_greedy`'s
    convention (EOS is the last token of a continuation that stopped on it).
    """
    gen = Generator.open(directory, threads, verify=False)  # the manifest was checked by the caller
    runs = []
    for prompt in prompts:
        result = gen.complete(prompt, SamplingParams(temperature=0.0), StopParams(max_new_tokens=max_new, seed=0))
        runs.append(list(result.token_ids) + ([gen.eos_id] if result.finish_reason == "eos" else []))
        on_done()
    return runs
