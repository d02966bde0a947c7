"""The static KV cache and its one update rule.

Every graph (and the PyTorch model, in the tests) takes the whole static cache as input,
`past_key.{i}` / `past_value.{i}` of shape [1, n_kv, max_seq, head_dim], plus `past_len`, the number of
filled rows, and returns only the S rows it computed, `present_key.{i}` / `present_value.{i}` of shape
[1, n_kv, S, head_dim]. Returning only the new rows keeps outputs small (S rows, not max_seq) and leaves
the buffers owned by the caller: they are allocated once and written in place here, never copied.
`write_rows` is the only place new rows enter a cache, for onnxruntime and PyTorch alike.

Sliding-window layers (Gemma 3, manifest format 8 `kv_cache_rows`) keep a ring of R = min(window, max_seq) rows:
position p lives in row p % R (`write_ring`), so the ring always holds the last R positions, all a window of
R can reach; a graph reading it knows each row's position from past_len alone (edgellm/model/layers.py) and,
keys being cached after RoPE, their order in the ring does not matter to the softmax. A ring of max_seq rows is
written exactly like a linear cache.

That is the "rows" layout. In the "inplace" layout (fused layer graphs, export/fused.py) a layer takes
`seqlens_k` / `total_len` instead of positions and `past_len`, and its `present_*` is the whole cache with rows
[past_len, past_len + S) written: bound to the same buffer as `past_*` (the runtime does), the graph writes
exactly the rows `write_rows` would, in place. Every caller (the diff, quantize, the export checks, the tests)
runs graphs through the runtime's Engine, so no other update path exists.
"""

from __future__ import annotations

import mmap

import numpy as np

from .errors import EdgeError
from .graphio import SPARE_ROWS, Dims


def write_rows(cache: np.ndarray, rows: np.ndarray, start: int, count: int) -> None:
    """Copy the first `count` of `rows` [1, n_kv, S, hd] into `cache` [1, n_kv, max_seq, hd] at `start`.

    `count` < S when the last prefill chunk is padded: padded rows are never written.
    """
    if start < 0 or start + count > cache.shape[2]:  # not need(): its message would be built on every step
        raise EdgeError(f"KV cache overflow: rows {start}..{start + count} do not fit max_seq={cache.shape[2]}")
    cache[:, :, start:start + count, :] = rows[:, :, :count, :]


def write_ring(cache: np.ndarray, rows: np.ndarray, start: int, count: int) -> None:
    """Copy the first `count` of `rows` [1, n_kv, S, hd] into the ring `cache` [1, n_kv, R, hd]: position
    start + j goes to row (start + j) % R; when count > R only the last R positions are kept (the earlier ones
    would be overwritten within this very write)."""
    r = cache.shape[2]
    if count == 1:
        cache[:, :, start % r, :] = rows[:, :, 0, :]
        return
    skip = max(0, count - r)
    slots = np.arange(start + skip, start + count) % r
    cache[:, :, slots, :] = rows[:, :, skip:count, :]


def step_feeds(kv_layout: str, start: int, seq: int, max_seq: int) -> dict[str, np.ndarray]:
    """The position inputs of a graph running S = `seq` tokens (real or padding) from position `start` (the
    Engine writes these values in place into the buffers it bound, tests/test_engine_rows.py checks they agree;
    the embed, stack and model graphs of an absolute position table take the same `positions`).

    rows: positions [1, S] (padding positions clamped to max_seq - 1: their rows are never used) and
    past_len [1]; inplace: seqlens_k [1] = start + S - 1 and total_len [] = start + S (int32, as
    GroupQueryAttention takes them; S rows are written, so start + S must fit the cache).
    """
    if kv_layout == "inplace":
        if start + seq > max_seq:
            raise EdgeError(f"KV cache overflow: rows {start}..{start + seq} do not fit max_seq={max_seq}")
        return {"seqlens_k": np.array([start + seq - 1], np.int32), "total_len": np.array(start + seq, np.int32)}
    positions = np.minimum(np.arange(start, start + seq, dtype=np.int64), max_seq - 1)[None, :]
    return {"positions": positions, "past_len": np.array([start], np.int64)}


def plan_calls(n: int, chunk: int, past: int, max_seq: int, kv_layout: str) -> list[tuple[int, int, int]]:
    """(offset into the tokens, real tokens, graph S) of each graph call that feeds `n` tokens after `past`
    filled rows: chunks of S = `chunk`, the last one padded; a lone token runs through the S = 1 graphs; and in
    the inplace layout, whose graphs write all S rows, a padded chunk that would end past `max_seq` goes token
    by token instead. The runtime's plan; everything that replays it (diff, quantize, export checks) uses it."""
    calls, i = [], 0
    while i < n:
        count = min(chunk, n - i)
        if count == 1 or (kv_layout == "inplace" and past + i + chunk > max_seq):
            calls.append((i, 1, 1))
            i += 1
        else:
            calls.append((i, count, chunk))
            i += count
    return calls


# a cache larger than this is mapped lazily (`zeroed`); a smaller one comes from malloc, in huge pages under
# `edgellm run` (cli/hugepages.py), resident in full from the start but 3.5-5 % faster to decode (stories110M
# int4, max_seq 256, 18.9 MB: 369 vs 356 tok/s mapped as one huge-page region, 361 vs 341 mapped per buffer, 8-10
# alternations; its peak RSS 4-7 MB lower mapped). SmolLM2-135M at max_seq 1024 (47 MB): mapped, peak RSS 244-248
# -> 208-211 MB for 268 -> 258 tok/s; at max_seq 8192 its cache is 377 MB, which malloc made resident before the
# first token
LAZY_CACHE_BYTES = 32 << 20


def zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero array in memory of its own, resident only where written: an anonymous map's pages are the kernel's
    zero page until a row lands in them. np.zeros gets its memory from malloc, which clears what it reuses, and
    under the huge-page malloc it faulted in 2 MiB pages around every layer's buffer (SmolLM2-135M at max_seq
    1024: 44 of the cache's 47 MB resident before the first token, 9 MB without huge pages)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype, count).reshape(shape)


class KVCache:
    """Preallocated per-layer key/value buffers and the number of filled rows."""

    def __init__(self, n_layers: int, n_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: np.dtype = np.float32, rows: tuple[int, ...] = ()) -> None:
        """`rows`: each layer's cache rows (graphio `Dims.all_rows`; () = max_seq each); fewer than max_seq is a
        ring, max_seq + SPARE_ROWS a fused-attention cache with its spare row (graphio.py)."""
        rows = tuple(rows) or (max_seq,) * n_layers
        if len(rows) != n_layers or not all(0 < r <= max_seq + SPARE_ROWS for r in rows):
            raise EdgeError(f"KV cache rows {rows}: expected {n_layers} entries in 1..{max_seq + SPARE_ROWS}")
        # zeros, not empty: unfilled rows are masked out, but must never hold NaN/Inf (0 * NaN = NaN)
        size = 2 * sum(rows) * n_kv_heads * head_dim * np.dtype(dtype).itemsize
        zeros = zeroed if size > LAZY_CACHE_BYTES else np.zeros
        self.keys = [zeros((1, n_kv_heads, r, head_dim), dtype) for r in rows]
        self.values = [zeros((1, n_kv_heads, r, head_dim), dtype) for r in rows]
        self.ring = [r < max_seq for r in rows]
        self.max_seq = max_seq
        self.length = 0

    @classmethod
    def for_dims(cls, dims: Dims) -> KVCache:
        """The cache an export's graphs read and write (`Manifest.dims`): its rows per layer, row width and dtype."""
        return cls(dims.n_layers, dims.n_kv_heads, dims.max_seq, dims.head_dim, np.dtype(dims.kv_dtype), dims.all_rows)

    @property
    def free(self) -> int:
        return self.max_seq - self.length

    def past_len(self) -> np.ndarray:
        """The `past_len` graph input: [1] int64."""
        return np.array([self.length], dtype=np.int64)

    def write(self, layer: int, key_rows: np.ndarray, value_rows: np.ndarray, count: int) -> None:
        """Write one layer's new rows at the current length (call `advance` once all layers are written)."""
        write = write_ring if self.ring[layer] else write_rows
        write(self.keys[layer], key_rows, self.length, count)
        write(self.values[layer], value_rows, self.length, count)

    def advance(self, count: int) -> None:
        if self.length + count > self.max_seq:  # not need(): its message would be built on every step
            raise EdgeError(f"KV cache overflow: {self.length}+{count} > {self.max_seq}")
        self.length += count

    def can_rewind(self, length: int) -> bool:
        """Whether `rewind(length)` keeps a valid context: a ring has overwritten the rows of the positions
        before the current length's window, so with ring layers only length 0 or the current length do."""
        return 0 <= length <= self.length and (length in (0, self.length) or not any(self.ring))

    def rewind(self, length: int) -> None:
        """Keep only the first `length` rows (a conversation that shares that prefix continues from there): the
        rows after it are overwritten by the next writes and never read before (every graph attends to the
        rows below the current length only)."""
        if not self.can_rewind(length):
            raise EdgeError(f"KV cache rewind to {length}: expected 0..{self.length}"
                            + (" (0 or the current length: ring caches)" if any(self.ring) else ""))
        self.length = length

    def reset(self) -> None:
        """Forget the context; the buffers stay allocated (stale rows are masked by past_len)."""
        self.length = 0
