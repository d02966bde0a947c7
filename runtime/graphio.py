"""The graph I/O contract: which files a graph lives in and its fixed input/output names and shapes.

Shared by the exporter (which writes graphs to it) and the manifest reader (which checks them against it);
see docs/design.md "Graph I/O names".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .errors import need
from .jsoncheck import is_int

# sanity bound: a corrupt n_layers must not make validation build billions of names, nor a (meta-device)
# ModelConfig billions of modules
MAX_LAYERS = 1024


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32", "int64"


@dataclass(frozen=True)
class Dims:
    """The sizes graph I/O shapes are made of."""

    n_layers: int
    n_kv_heads: int
    head_dim: int  # of the cache rows (graph I/O): the model's, or larger for zero-padded heads (kv_head_dim)
    dim: int
    vocab_size: int
    max_seq: int
    kv_layout: KVLayout = "rows"  # "rows": layers return the S new rows; "inplace": layers write the cache in place
    model_head_dim: int = 0  # the model's head size: the first model_head_dim entries of a cached row are its K/V
    # absolute position embeddings (GPT-2, config pos_embedding learned|sinusoidal, format 8): the embedding reads
    # `positions` [1, S] too (the embed, stack and model graphs), gathering rows of its position table
    embed_positions: bool = False
    rows: tuple[int, ...] = ()  # rows of each layer's cache (`cache_rows`); () = max_seq + spare for every layer
    spare: int = 0  # SPARE_ROWS for "inplace" exports of format 10+, else 0
    kv_dtype: str = "float32"  # of the cache tensors (past_* / present_*): KV_DTYPES, float16 since 14, int8 since 15

    def ring(self, layer: int) -> bool:
        """Whether `layer`'s cache is a ring the fused graph attends in standard ops (`ring_layers`): fewer rows
        than a full-attention cache. (KVCache.ring asks another question, fewer rows than max_seq: how rows are
        written; a ring of max_seq rows is written like a linear cache.)"""
        return self.layer_rows(layer) < self.max_seq + self.spare

    def layer_rows(self, layer: int) -> int:
        """Rows of `layer`'s cache: max_seq (+ the spare row of fused attention), or fewer for a sliding-window
        layer (a ring, runtime/kvcache.py)."""
        return self.rows[layer] if self.rows else self.max_seq + self.spare

    @property
    def all_rows(self) -> tuple[int, ...]:
        """`layer_rows` of every layer: the shapes a KVCache allocates."""
        return tuple(self.layer_rows(i) for i in range(self.n_layers))


# the cache's element type (manifest `kv_dtype`, format 14; int8 15): fp16 halves the cache's bytes, int8 quarters
# them; only the fused layers (kv_layout "inplace") write either: fp16 by casting GroupQueryAttention's inputs to it
# (export/fused.py), int8 by the kernel itself with static per-channel scales (quant/kv_int8.py)
KV_DTYPES = ("float32", "float16", "int8")
# a sliding-window layer's cache (manifest `sliding_cache`, format 16): "ring", only the rows its window reaches
# where that is fewer than max_seq (attended in standard ops); "full", max_seq + spare rows like a full layer
# (GroupQueryAttention with local_window_size: faster, the cache as long as a full layer's)
SLIDING_CACHES = ("ring", "full")
# how far an fp16 cache may move what a graph computes, relative to max(1, max |output|), in every check that
# compares it with an fp32 computation (export against PyTorch, the stack against its layer graphs): the cached rows
# are rounded to fp16 (2^-11 relative; ~1e-3 on the N(0,1) verification inputs), attention reads q, k, v at that
# precision, and a last-bit difference upstream can move a row by a whole fp16 step (SmolLM2-135M-Instruct: layers
# 1.8-5.8e-4, stack vs layers 5.0e-4, end to end 2.5e-3)
FP16_CACHE_ATOL = 4e-3
KVLayout = Literal["rows", "inplace"]  # manifest `kv_layout` (docs/design.md, "The KV cache")
KV_LAYOUTS: tuple[KVLayout, ...] = get_args(KVLayout)
POS_EMBEDDINGS = ("rope", "learned", "sinusoidal")  # config.pos_embedding; absent (formats 1-7): "rope"

# The fused layers (kv_layout "inplace", manifest format 10+) run GroupQueryAttention on S + 1 rows: the S real
# ones and a zero row after them, whose K/V land in the row after the real ones (export/fused.py says why). So a
# full-attention cache holds max_seq + SPARE_ROWS rows; the spare row is never attended by a real row.
SPARE_ROWS = 1
STACK_ROLES = ("stack", "stack_lone")  # the stack graph, and the same without the spare row (format 13)
SPARE_SINCE = 10  # the manifest format that added the extra row


def spare_rows(kv_layout: str, format_version: int) -> int:
    """Extra rows of each full-attention cache: SPARE_ROWS for fused ("inplace") graphs of format 10+, else 0."""
    return SPARE_ROWS if kv_layout == "inplace" and format_version >= SPARE_SINCE else 0


def ring_layers(config: dict, max_seq: int, cover: bool = True, sliding_cache: str = "ring") -> tuple[bool, ...]:
    """Which layers keep a ring cache — the one rule export, the manifest and the runtime's sizes share: a layer
    whose `layer_types` entry is "sliding" (Gemma 3) never attends further back than its window, so under
    `sliding_cache` "ring" its cache holds only the rows the window reaches; `cover` (format 16+): unless the window
    covers max_seq (window >= max_seq), where it never masks a position and the layer is a full one (its own RoPE
    table still, GroupQueryAttention in the fused export). `sliding_cache` "full" (format 16+, `export
    --sliding-cache full`): no rings, the window applied by GroupQueryAttention's local_window_size. () for configs
    without the keys (every manifest before format 8): full layers only."""
    n = config.get("n_layers")
    types, window = config.get("layer_types"), config.get("sliding_window")
    if types is None or not is_int(n):
        return ()
    need(isinstance(types, list | tuple) and len(types) == n and all(t in ("full", "sliding") for t in types),
         f"config.layer_types: expected {n} entries of 'full' or 'sliding'")
    need("sliding" not in types or (is_int(window) and window > 0),
         "config.sliding_window: expected a positive integer for sliding layers")
    need(sliding_cache in SLIDING_CACHES,
         f"sliding_cache: expected one of {', '.join(SLIDING_CACHES)}, got {sliding_cache!r:.40}")
    kept = sliding_cache == "ring" and not (cover and window >= max_seq)
    return tuple(t == "sliding" and kept for t in types)


def cache_rows(config: dict, max_seq: int, extra: int = 0, spare: int = 0, cover: bool = False,
               sliding_cache: str = "ring") -> tuple[int, ...]:
    """Rows of each layer's cache: max_seq + `spare`, or for a ring (`ring_layers`) min(sliding_window + extra,
    max_seq), position p in row p % rows (runtime/kvcache.py). `extra`: prefill_chunk - 1 for kv_layout "inplace",
    whose fused layers write the chunk's rows before reading the ring (export/fused_ring.py)."""
    window = config.get("sliding_window")
    return tuple(min(window + extra, max_seq) if ring else max_seq + spare
                 for ring in ring_layers(config, max_seq, cover, sliding_cache))


def dims_from_config(config: dict, max_seq: int, kv_layout: KVLayout = "rows", kv_head_dim: int | None = None,
                     prefill_chunk: int = 1, spare: int = 0, kv_dtype: str = "float32", cover: bool = False,
                     sliding_cache: str = "ring") -> Dims:
    """Read the ModelConfig field names from a config dict; head_dim null/absent => dim // n_heads.

    `kv_head_dim` (manifest format 7; None: the model's head_dim): the width of a cache row when the graphs pad
    every head with zeros (a head size onnxruntime's GroupQueryAttention refuses, export/fused.py): row
    [k_0 .. k_{hd-1}, 0 .. 0]. It sizes the cache and the graph I/O; nothing is inferred from names."""
    need(isinstance(config, dict), "config: expected an object")
    need(kv_layout in KV_LAYOUTS, f"kv_layout: expected one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    need(kv_dtype in KV_DTYPES, f"kv_dtype: expected one of {', '.join(KV_DTYPES)}, got {kv_dtype!r:.40}")
    need(kv_dtype == "float32" or kv_layout == "inplace",
         f"kv_dtype: a {kv_dtype} cache is written by the fused layers only (kv_layout 'inplace'), got {kv_layout!r}")

    def size(key: str) -> int:
        need(key in config, f"config: missing key {key!r}")
        need(is_int(config[key]) and config[key] > 0, f"config.{key}: expected a positive integer")
        return config[key]

    need(size("n_layers") <= MAX_LAYERS, f"config.n_layers: expected <= {MAX_LAYERS}")
    head_dim = size("head_dim") if config.get("head_dim") is not None else size("dim") // size("n_heads")
    need(head_dim > 0, "config: dim // n_heads must be positive")
    cache = head_dim if kv_head_dim is None else kv_head_dim
    need(is_int(cache) and head_dim <= cache <= head_dim + 8,  # padding to a multiple of 8 adds 7 at most
         f"kv_head_dim: expected an integer from the model's head_dim {head_dim} to {head_dim + 8}, got {cache!r}")
    pos = config.get("pos_embedding", "rope")
    need(pos in POS_EMBEDDINGS, f"config.pos_embedding: expected one of {', '.join(POS_EMBEDDINGS)}, got {pos!r:.40}")
    rows = cache_rows(config, max_seq, prefill_chunk - 1 if kv_layout == "inplace" else 0, spare, cover,
                      sliding_cache)
    return Dims(size("n_layers"), size("n_kv_heads"), cache, size("dim"), size("vocab_size"), max_seq, kv_layout,
                head_dim, pos != "rope", rows, spare, kv_dtype)


def graph_paths(role: str, seq: int, layer: int | None = None) -> tuple[str, str, str]:
    """(graph name, .onnx file, external-data file) in the standard layout: ("layer_3.decode", ...)."""
    stem = f"layer_{layer}" if role == "layer" else role
    name = f"{stem}.{'decode' if seq == 1 else 'prefill'}"
    return name, f"{name}.onnx", f"{stem}.data"


def graph_io(role: str, seq: int, layer: int | None, dims: Dims) -> tuple[tuple[TensorSpec, ...],
                                                                          tuple[TensorSpec, ...]]:
    """The fixed (inputs, outputs) of a graph; see docs/design.md "Graph I/O names"."""
    d, s = dims, seq

    def f32(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, shape, "float32")

    def i64(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, shape, "int64")

    def i32(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, shape, "int32")

    positions = (i64("positions", 1, s),) if d.embed_positions else ()  # the embedding's, absolute tables only
    if role == "embed":
        return (i64("tokens", 1, s), *positions), (f32("hidden", 1, s, d.dim),)
    if role == "head":
        return (f32("hidden", 1, s, d.dim),), (f32("logits", 1, s, d.vocab_size),)
    # "stack" (format 4, optional): the embedding and every layer in one graph, tokens -> hidden_out;
    # "stack_lone" (format 13, optional): the same I/O (edgellm/layout/lone.py)
    need(role in ("layer", "model", *STACK_ROLES),
         f"graph role: expected one of embed, layer, head, model, stack, stack_lone, got {role!r}")
    layers = [layer] if role == "layer" else list(range(d.n_layers))
    first_in = f32("hidden", 1, s, d.dim) if role == "layer" else i64("tokens", 1, s)
    first_out = f32("logits", 1, s, d.vocab_size) if role == "model" else f32("hidden_out", 1, s, d.dim)
    past = [TensorSpec(f"past_{kv}.{i}", (1, d.n_kv_heads, d.layer_rows(i), d.head_dim), d.kv_dtype)
            for i in layers for kv in ("key", "value")]
    need(role not in STACK_ROLES or d.kv_layout == "inplace", "stack graphs exist for kv_layout 'inplace' only")
    if d.kv_layout == "inplace":  # GroupQueryAttention's lengths; present_* = the whole cache, written in place
        need(role != "model", "kv_layout 'inplace' exists for layer graphs only (granularity 'layer')")
        return ((first_in, *(positions if role in STACK_ROLES else ()), i32("seqlens_k", 1), i32("total_len"), *past),
                (first_out, *(TensorSpec(t.name.replace("past_", "present_"), t.shape, t.dtype) for t in past)))
    present = [f32(f"present_{kv}.{i}", 1, d.n_kv_heads, s, d.head_dim) for i in layers for kv in ("key", "value")]
    return (first_in, i64("positions", 1, s), i64("past_len", 1), *past), (first_out, *present)


def check_io(role: str, seq: int, layer: int | None,
             io: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]], dims: Dims, where: str) -> None:
    """A manifest graph entry's (inputs, outputs) are exactly `graph_io`'s (any order); EdgeError naming
    `where` and the tensor otherwise."""
    want_in, want_out = graph_io(role, seq, layer, dims)
    for side, got, want in (("inputs", io[0], want_in), ("outputs", io[1], want_out)):
        need(sorted(t.name for t in got) == sorted(t.name for t in want),  # any order, each name once
             f"{where}.{side}: expected names {[t.name for t in want]}, got {[t.name for t in got]}")
        by_name = {t.name: t for t in got}
        for t in want:
            have = by_name[t.name]
            need(have == t, f"{where}.{side}.{t.name}: expected {list(t.shape)} {t.dtype}, "
                            f"got {list(have.shape)} {have.dtype}")
