"""The forward pass through an export's graphs: tokens in, the last token's logits out, KV rows written.

Two layouts (manifest `granularity`):
- "layer": embed -> layer_0 .. layer_{N-1} -> head, one session each, at S = prefill_chunk and S = 1; or,
  when the export has a stack graph (edgellm/layout/stacking.py) and `SessionConfig.stack`, stack -> head
  (the lone-row stack of format 13 instead when `SessionConfig.exact` is off: edgellm/layout/lone.py).
- "model": one session per S.
Which sessions pre-pack their weights and which read them in place is `placement.plan`'s (weights are held
once). Every buffer a graph reads or writes is allocated once (wiring.py: which graph binds which) and bound
once (see `session.BoundGraph`); a step only writes the token ids and position inputs in place, runs the
graphs, and copies each layer's new K/V rows into the cache with `KVCache.write` (the one cache-update rule).
With kv_layout "inplace" (fused layer graphs) each layer's present_* is bound to its cache buffers themselves:
the graph writes the rows.

Prefill runs the prompt in chunks of S = prefill_chunk; the last chunk is padded with token 0 and only its
real rows are written to the cache (padding comes after the real tokens, so the causal mask keeps it out
of every real row). A 1-token remainder uses the S = 1 graphs instead; so does an inplace chunk whose padding
would run past the end of the cache (the graph writes all S rows): `kvcache.plan_calls`. With layer granularity the head runs
once per prompt, on the last real row only, through its S = 1 graph: the prefill head's [S, V] logits
would be thrown away but for one row. `forward_rows` (teacher forcing, perplexity, speculative decoding's
verification) wants every row's logits instead: its prefill chunks go through the S = prefill_chunk head,
opened on its first call.

`few_rows` (speculative decoding's verification: the last token + k drafts) runs the paired stack and head
(format 9) at S = n itself, bound to the decode sessions: no padding, the head on exactly those rows.

Logits come in vocabulary order from `forward`, `forward_rows` and `few_rows`. A head whose columns are in
another order (manifest format 12 `logit_columns`: a head quantized by rows) is read through `columns`
(runtime/columns.py): the decode loop calls `forward_columns` / `few_columns` and picks with `columns.token`,
so a greedy step never reorders the vector.

A `hook` (forward_rows) sees every graph's bound buffers right after that graph ran (`GraphRun`): the diff
reads the hidden state after each layer from it; the K/V rows are in the cache once the call returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .columns import Columns
from .errors import EdgeError
from .fileio import safe_join
from .kvcache import KVCache, plan_calls
from .manifest import Manifest
from .placement import plan
from .session import (
    BoundGraph,
    RunClock,
    SessionConfig,
    check_onnxruntime,
    open_placed,
)
from .variant import LONE_EXACT, GraphRun, Hook, Variant, runs_stack, stack_role
from .weightmap import SharedWeights
from .wiring import Lengths, wire_layers, wire_model, wire_stack

if TYPE_CHECKING:
    from onnxruntime import InferenceSession


# lookup tables (placement.py) are released at most this often: a release (madvise, then a page fault per
# row read after it) costs ~0.1-0.3 ms with the thread pool's TLBs to flush, < 1 % of 50 ms at any step time;
# RSS then holds at most the folios of the tokens read in the last 50 ms
TABLE_INTERVAL_S = 0.05


class Engine:
    """Runs tokens through the graphs of one export directory, writing the KV cache."""

    def __init__(self, directory: Path, manifest: Manifest, cache: KVCache, config: SessionConfig,
                 clock: RunClock) -> None:
        self.directory, self.manifest, self.cache, self.clock = Path(directory), manifest, cache, clock
        check_onnxruntime(manifest.kv_dtype, str(directory))
        self.config = config
        self.layered = manifest.granularity == "layer"
        self.stacked = runs_stack(manifest, config)
        self.stack_role = stack_role(manifest, config)  # "stack", or "stack_lone" for a sampled run (lone.py)
        # whether `few_rows` runs n tokens as one S = n call: the stack and the head are paired graphs (S symbolic;
        # manifest format 9), so no row is padding and the head runs on exactly those n rows
        self.any_rows = self.stacked and all(manifest.graph(r, 1).paired for r in (self.stack_role, "head"))
        # whether each row `few_rows` returns is bit for bit what a decode step of that token returns: the fused
        # attention's extra row (its spare cache row, graphio.spare_rows) makes every call >= 2 rows, matmuls are
        # row-exact; then greedy speculation gives plain decoding's tokens whatever the precision (not so in the
        # lone-row stack, which leaves that row out, unless its cache type makes every row alike: variant.LONE_EXACT)
        lone_exact = manifest.kv_dtype in LONE_EXACT
        self.exact_rows = self.any_rows and manifest.dims.spare > 0 and (self.stack_role == "stack" or lone_exact)
        self.in_place = manifest.kv_layout == "inplace"
        # the cache-length inputs every graph reads (wiring.Lengths), written in place by each step
        self.lengths = Lengths(np.zeros(1, np.int64), np.zeros(1, np.int32), np.zeros((), np.int32))
        self.placement = plan(self.directory, manifest, config.prepack_prefill, self.stacked, self.stack_role)
        self.tables = tuple(sorted({rel for p in self.placement.values() for rel in p.tables}))
        self.weights = SharedWeights(self.directory, self.tables)
        self.table_interval_s = TABLE_INTERVAL_S
        self._tables_released = time.perf_counter()
        self.chunk = manifest.prefill_chunk
        cols = manifest.logit_columns
        self.columns = Columns.read(safe_join(self.directory, cols) if cols else None, manifest.vocab_size)
        self._paired: dict[str, InferenceSession] = {}  # paired graph file -> its one session
        self._rows_head: Variant | None = None  # the S = prefill_chunk head (forward_rows), opened on first use
        self._few: dict[int, Variant] = {}  # S = n variants of the paired stack + head (few_rows), built on first use
        # their logits: rows [0, n) of one [1, N, V] buffer (a verification reads only its own call's rows), not a
        # buffer per n: at k = 1..16 that is 17 rows of V instead of 152 (Qwen2.5-0.5B's 151936: 10.3 vs 92 MB)
        self._few_logits = np.zeros((1, 0, manifest.vocab_size), np.float32)
        if self.layered and manifest.graph("head", 1).paired:
            # the head before any other graph: pre-packing it (a tied table: the largest weight) peaks at its
            # file's bytes plus the packed copy, then on a heap holding nothing else; opened after the layers,
            # that peak came on top of all their packed weights (Qwen2.5-0.5B int4: 748 vs 621 MB peak RSS)
            self._session("head", 1)  # kept in self._paired for both variants
        # decode graphs first: if the prefill graphs fail to load, nothing of them stays half-built
        self.decode = self._build(1)
        self.prefill = self._build(self.chunk) if self.chunk > 1 else self.decode

    @classmethod
    def open(cls, directory: Path, manifest: Manifest, config: SessionConfig | None = None) -> Engine:
        """An Engine with an empty cache of its own (`engine.cache`) and its own clock: for the host-side
        callers (diff, quantize's checks, export's end-to-end check); the Generator passes its own."""
        return cls(directory, manifest, KVCache.for_dims(manifest.dims),
                   config if config is not None else SessionConfig(), RunClock())

    # ----------------------------------------------------------------------------------------- building

    def _session(self, role: str, seq: int, layer: int | None = None):
        """A session placed as `placement.plan` says: pre-packed from its own load, or reading the maps. A
        paired graph's two variants share one session (and one packed copy of the weights)."""
        spec = self.manifest.graph(role, seq, layer)
        session = self._paired.get(spec.file) if spec.paired else None
        if session is None:
            path = safe_join(self.directory, spec.file)
            session = open_placed(path, spec, self.placement[spec.name], self.config, self.weights)
        if spec.paired:
            self._paired[spec.file] = session
        return session, spec

    def _build(self, seq: int) -> Variant:
        m = self.manifest
        v = Variant(seq)
        if not self.layered:
            wire_model(v, m, self.cache, self.lengths, self._bind)
            v.body, v.release = list(v.graphs), [self.placement[v.specs[0].name].release]
            v.releases = any(v.release)
            return v
        if self.stacked:
            wire_stack(v, m, self.cache, self.stack_role, self.lengths, self._bind)
        else:
            wire_layers(v, m, self.cache, self.in_place, self.lengths, self._bind)
        v.body = list(v.graphs)
        v.release = [self.placement[g.where].release for g in v.body]
        v.releases = any(v.release)
        if seq == 1:  # the head runs only at S = 1 (see the module docstring)
            v.logits = np.zeros((1, 1, m.vocab_size), np.float32)
            self._bind(v, "head", 1, None, {"hidden": v.hidden_out}, {"logits": v.logits})
        return v

    def _bind(self, v: Variant, role: str, seq: int, layer: int | None, inputs: dict[str, np.ndarray],
              outputs: dict[str, np.ndarray], spec_seq: int | None = None) -> None:
        """Open (or share) the graph's session, bind its buffers and append it to the variant (wiring.Bind).
        `spec_seq`: the manifest variant whose (paired, S-symbolic) session runs this S (few_rows)."""
        session, spec = self._session(role, spec_seq or seq, layer)
        v.graphs.append(BoundGraph(session, inputs, outputs, self.clock, spec.name))
        v.specs.append(spec)

    # ------------------------------------------------------------------------------------------ running

    def forward(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feed `tokens` (all must fit in the cache); return the last one's logits [V] in vocabulary order (a
        view of a buffer the next call overwrites; a new array where `columns` reorders)."""
        return self.columns.vocab(self.forward_columns(tokens))

    def forward_columns(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`forward` with the logits in the head's column order (`columns`), always a view."""
        n = len(tokens)
        if not 0 < n <= self.cache.free:  # not need(): its message would be formatted on every step
            raise EdgeError(f"forward: {n} tokens do not fit the {self.cache.free} free cache rows")
        if n == 1:
            self._run_chunk(self.decode, tokens, 1)
            return self._logits(self.decode, 1)
        cache = self.cache
        for start, count, seq in plan_calls(n, self.chunk, cache.length, cache.max_seq, self.manifest.kv_layout):
            variant = self.decode if seq == 1 else self.prefill
            self._run_chunk(variant, tokens[start:start + count], count)
        return self._logits(variant, count)

    def forward_rows(self, tokens: Sequence[int] | np.ndarray, hook: Hook | None = None) -> np.ndarray:
        """Feed `tokens` (all must fit in the cache) like `forward`, through the same graph calls
        (`kvcache.plan_calls`); return the logits of every one of them, [n, V] float32 (a new array): row i
        predicts the token after tokens[i]. A lone token costs what `forward` does; a prefill chunk's head runs
        at S = prefill_chunk (layer granularity). `hook`, when given, is called with a `GraphRun` right after
        each graph ran, the head included. The cache advances by n (`KVCache.rewind` takes rows back)."""
        return self.columns.vocab(self._rows(tokens, hook))

    def _rows(self, tokens: Sequence[int] | np.ndarray, hook: Hook | None = None) -> np.ndarray:
        """`forward_rows` in column order (a new array)."""
        n = len(tokens)
        if not 0 < n <= self.cache.free:
            raise EdgeError(f"forward_rows: {n} tokens do not fit the {self.cache.free} free cache rows")
        rows = np.empty((n, self.manifest.vocab_size), np.float32)
        cache = self.cache
        for start, count, seq in plan_calls(n, self.chunk, cache.length, cache.max_seq, self.manifest.kv_layout):
            variant = self.decode if seq == 1 else self.prefill
            self._run_chunk(variant, tokens[start:start + count], count, hook)
            rows[start:start + count] = self._all_logits(variant, count, hook)
        return rows

    def few_rows(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`forward_rows` for a few tokens (a speculative verification: the last token + k drafts): logits
        [n, V] in vocabulary order (a view of a buffer the next call overwrites, or a new array). With
        `any_rows`, one call of the stack and the head at S = n, sharing the decode sessions; otherwise
        `forward_rows` (prefill chunk padded)."""
        return self.columns.vocab(self.few_columns(tokens))

    def few_columns(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`few_rows` in the head's column order (`columns`)."""
        n = len(tokens)
        if n == 1 or not self.any_rows:
            return self._rows(tokens)
        if not n <= self.cache.free:
            raise EdgeError(f"few_rows: {n} tokens do not fit the {self.cache.free} free cache rows")
        v = self._few.get(n)
        if v is None:
            self.reserve_rows(n)  # a no-op unless n outgrows the buffer
            v = self._few[n] = Variant(n)
            wire_stack(v, self.manifest, self.cache, self.stack_role, self.lengths, self._bind, spec_seq=1)
            v.body, v.release = list(v.graphs), [()]
            v.logits = self._few_logits[:, :n]
            self._bind(v, "head", n, None, {"hidden": v.hidden_out}, {"logits": v.logits}, spec_seq=1)
        self._run_chunk(v, tokens, n)
        v.graphs[-1].run()
        return v.logits[0]

    def reserve_rows(self, n: int) -> None:
        """Size the logits buffer `few_rows` shares for calls of up to n tokens (the Generator reserves k_max + 1
        when speculation is set up; a larger call grows it, rebuilding the few variants bound so far)."""
        if n > self._few_logits.shape[1]:
            self._few_logits = np.zeros((1, n, self.manifest.vocab_size), np.float32)
            self._few.clear()

    def _all_logits(self, v: Variant, count: int, hook: Hook | None) -> np.ndarray:
        """Logits [count, V] of the chunk `v` just ran (a view)."""
        if self.layered:
            if v.seq > 1 and self._rows_head is None:
                self._rows_head = Variant(v.seq)
                self._rows_head.logits = np.zeros((1, v.seq, self.manifest.vocab_size), np.float32)
                self._bind(self._rows_head, "head", v.seq, None, {"hidden": v.hidden_out},
                           {"logits": self._rows_head.logits})
                self._rows_head.release = [self.placement[self._rows_head.specs[0].name].release]
            head = self.decode if v.seq == 1 else self._rows_head
            head.graphs[-1].run()
            if v.seq > 1 and head.release[0]:  # placed like the other prefill graphs (placement.py)
                self.weights.release(head.release[0])
            if hook is not None:
                graph = head.graphs[-1]
                hook(GraphRun(head.specs[-1], graph.inputs, graph.outputs, self.cache.length - count, count))
            v = head
        return v.logits[0, :count]

    def _run_chunk(self, v: Variant, tokens: Sequence[int] | np.ndarray, count: int,
                   hook: Hook | None = None) -> None:
        cache = self.cache
        length = cache.length
        v.tokens[0, :count] = tokens
        if count < v.seq:
            v.tokens[0, count:] = 0
        if self.in_place:
            self.lengths.seqlens_k[0] = length + v.seq - 1
            self.lengths.total_len[()] = length + v.seq
        else:
            self.lengths.past_len[0] = length
        if v.seq == 1:  # (inplace layers read no positions; an absolute position table does)
            v.positions[0, 0] = length
        else:  # padded rows get valid positions too (clamped): their values are never used
            np.minimum(np.arange(length, length + v.seq), cache.max_seq - 1, out=v.positions[0])
        if v.releases or hook is not None:
            for graph, spec, release in zip(v.body, v.specs, v.release, strict=False):  # specs: + the head's
                graph.run()
                if hook is not None:
                    hook(GraphRun(spec, graph.inputs, graph.outputs, length, count))
                if release:  # a prefill graph's unpacked weights: out of RSS until its next run
                    self.weights.release(release)
        else:
            for graph in v.body:
                graph.run()
        for i in range(len(v.keys)):  # none when the layers wrote the cache in place
            cache.write(i, v.keys[i], v.values[i], count)
        cache.advance(count)
        if self.tables and time.perf_counter() - self._tables_released >= self.table_interval_s:
            self.weights.release(self.tables)
            self._tables_released = time.perf_counter()

    def _logits(self, v: Variant, count: int) -> np.ndarray:
        if not self.layered:
            return v.logits[0, count - 1]
        if v.seq > 1:  # copy the last real row into the S = 1 head's input, then run that head
            self.decode.hidden_out[0, 0] = v.hidden_out[0, count - 1]
        self.decode.graphs[-1].run()
        return self.decode.logits[0, 0]
