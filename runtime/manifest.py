"""manifest.json: the one file the runtime reads first, describing an export directory.

Format "edgellm-export", versions (bump on any change to graph I/O names, cache layout or file layout;
readers accept exactly the versions in READS; older ones get a one-line "re-export with this version"):
  8  embed/layer/head graphs (or one model graph) at S = prefill_chunk and S = 1 sharing one data file,
     `kv_layout` rows | inplace, `paired` graphs (one graph, S symbolic: edgellm/layout/pairing.py), the
     optional "stack", `eos_ids`, `tokenizer` {file, kind hf | llama2c, chat_template, add_bos}, `kv_head_dim`
     (docs/design.md, "Export directory"); models with absolute position embeddings (GPT-2 / seed 004:
     `config.pos_embedding` "learned" or "sinusoidal"; graphio.Dims.embed_positions): the embed, stack and model
     graphs take `positions` [1, S] int64 (absolute positions of the S rows, padding clamped to max_seq - 1) and
     gather their position table's rows, their layer graphs rotate nothing; `kv_cache_rows` (a list with each
     layer's cache rows, or null: max_seq for every layer): a sliding-window layer (Gemma 3, config
     layer_types/sliding_window) keeps min(window, max_seq) rows as a ring ("rows" layout; "inplace": window +
     prefill_chunk - 1, export/fused_ring.py), position p in row p % rows (runtime/kvcache.py); its past_key.i /
     past_value.i are [1, n_kv, rows, hd]. It must equal what the config implies (graphio.cache_rows). Every
     file listed with sha256 and byte size.
  9  the head may be paired (`head.onnx`, both variants, S symbolic; export writes it with the stack): one
     session serves S = 1 and any other row count, e.g. the k + 1 rows of a speculative verification
     (runtime/speculative.py). Version 8 has unpaired heads only.
 10  kv_layout "inplace": every full-attention cache holds max_seq + 1 rows (graphio.SPARE_ROWS): the fused
     layers run GroupQueryAttention on S + 1 rows, the last a zero row whose K/V go to the row after the real
     ones, so a decode step computes its row exactly as a k + 1 row verification does (export/fused.py). Versions
     8-9 have max_seq rows and no such row (Manifest.format_version keeps which).
 11  a Hugging Face tokenizer ships as `tokenizer.json.xz` (runtime/tokenizer.py; readers unpack by the name in
     `tokenizer.file`, so a 10's tokenizer.json still reads); a tied table is stored once as E [V, D], the head
     reading it as Gemm(h, E, transB=1) and the embedding gathering rows (export/graphs.py; 10 stored E^T [D, V]
     and gathered columns). The graphs' I/O is unchanged.
 12  `logit_columns` (null, or a listed file of V int32 little-endian token ids): the head's logits come in that
     column order (a head quantized by rows computes its int8 and int4 rows apart, quant/headsplit.py) and the
     runtime reads them through runtime/columns.py instead of the graph gathering them back (11 did that in the
     graph). Nothing else changed: a quantize of a 10 or 11 export that splits the head writes 12.
 13  an optional second stack, role "stack_lone" (`stack_lone.onnx`, paired, the stack's I/O, reading its data
     files): the stack without the spare attention row (edgellm/layout/lone.py), which sampled runs open for
     8-27 % faster decode (`SessionConfig.exact = False`); greedy runs keep the stack. Written with every stack
     of an export with the spare row; a quantize of a 10-12 export writes 13.
 14  `kv_dtype` "float32" | "float16" (graphio.KV_DTYPES): the cache tensors' element type, past_* / present_* of
     every graph and the buffers `KVCache` allocates. fp16 is written by the fused layers only (kv_layout
     "inplace": GroupQueryAttention's inputs cast to it, its output back to fp32, export/fused.py); 8-13 read
     as "float32".
 15  `kv_dtype` "int8" (`quantize --kv-dtype int8`, quant/kv_int8.py): GroupQueryAttention quantizes the rows it
     writes and dequantizes what it reads, with static symmetric scales per (kv head, channel) held in each layer
     graph; nothing else changed (a reader of 14 refuses 15 by its version, as it would any newer format).
 16  a sliding-window layer whose window covers max_seq (sliding_window >= max_seq: the window never masks a
     position) is a full layer: max_seq + 1 cache rows, GroupQueryAttention with its own RoPE table instead of a
     ring in standard ops (graphio.cache_rows `cover`; Gemma 3 at max_seq <= 512); and `sliding_cache` "ring" |
     "full" (graphio.SLIDING_CACHES; `export --sliding-cache full`: every sliding layer so, its window applied by
     GroupQueryAttention's local_window_size). Export writes 16 only where either applies (else 14): an older
     reader refuses such an export by its version, not by a cache shape.

Graph I/O names and shapes are fixed by `graph_io`; export builds its graphs from it and `read_manifest`
checks every graph against it, so a mismatch fails at load time with the key at fault, not mid-generation.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from .errors import EdgeError, need
from .fileio import FileSpec, atomic_write_text, check_files
from .graphio import KV_LAYOUTS, Dims, KVLayout, TensorSpec, dims_from_config, spare_rows
from .jsoncheck import is_int
from .manifest_checks import ROLES_BY_GRANULARITY, check_graphs, check_tokenizer
from .sampling import SamplingParams

FORMAT = "edgellm-export"
FORMAT_VERSION = 14  # what export writes; quantize writes 15 only for an int8 cache (KV_INT8_SINCE)
READS = (8, 9, 10, 11, 12, 13, 14, 15, 16)  # the versions this reader accepts (1-7: older edgellm releases, re-export)
MANIFEST = "manifest.json"
Granularity = Literal["layer", "model"]  # graphs per layer (+ embed, head, stack) or one model graph
COLUMNS_SINCE = 12  # the first format with `logit_columns`
LONE_SINCE = 13  # the first format with a "stack_lone" graph
KV_DTYPE_SINCE = 14  # the first format with `kv_dtype`
KV_INT8_SINCE = 15  # the first format whose `kv_dtype` may be "int8"
COVER_SINCE = 16  # the first format where a sliding window covering max_seq makes a full layer (graphio.cache_rows)
_MAX_MANIFEST_BYTES = 64 << 20
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"  # a JSON number, for to_json's one-line arrays
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class GraphSpec:
    name: str                 # "layer_3.decode"; keys `verification`
    role: str                 # embed | layer | head | model | stack
    layer: int | None         # the layer index for role "layer", else None
    seq: int                  # S: prefill_chunk or 1
    file: str                 # the .onnx file, relative to the export dir
    data: str | None          # its external-data file (shared by the prefill and decode variants); a stack
                              # graph reads the embed and layer data files: null
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    paired: bool = False      # the file holds both variants: one graph, S symbolic (edgellm/layout/pairing.py)


@dataclass(frozen=True)
class Manifest:
    """An export directory's description. Constructing one validates it (EdgeError naming the key)."""

    edgellm_version: str
    preset: str | None
    config: dict                                 # ModelConfig fields, as plain JSON
    granularity: Granularity
    kv_layout: KVLayout                          # runtime/kvcache.py
    max_seq: int
    prefill_chunk: int
    opset: int
    graphs: tuple[GraphSpec, ...]
    files: dict[str, FileSpec]                   # every file but manifest.json, by relative path
    tokenizer: dict | None = None                # {"file": relpath, "kind": "hf" | "llama2c", "chat_template": relpath | None,
                                                 #  "add_bos": bool}
    bos_id: int | None = None
    eos_id: int | None = None
    eos_ids: tuple[int, ...] = ()                # every id that ends generation: eos_id first, or none
    sampler: dict = field(default_factory=dict)  # SamplingParams fields (defaults for `edgellm run`)
    quantization: dict | None = None             # None for fp32
    export_options: dict = field(default_factory=dict)
    verification: dict[str, float] = field(default_factory=dict)  # graph name -> max |diff| / max(1, |ref|) vs PyTorch
    kv_head_dim: int | None = None               # cache row width if heads are zero-padded (format 7), else null
    kv_cache_rows: tuple[int, ...] | None = None  # each layer's cache rows when some are rings (format 8), else null
    logit_columns: str | None = None             # the head's column -> token id file (format 12), else null
    kv_dtype: str = "float32"                    # the cache's element type (format 14; graphio.KV_DTYPES)
    sliding_cache: str = "ring"                  # sliding-window layers' caches (format 16; graphio.SLIDING_CACHES)
    format_version: int = FORMAT_VERSION  # what the graphs were written as (< 10: no spare cache row)

    def __post_init__(self) -> None:
        self.validate()

    @cached_property
    def dims(self) -> Dims:
        """The graph sizes, derived once (the fields are frozen; `validate` builds them first)."""
        return dims_from_config(self.config, self.max_seq, self.kv_layout, self.kv_head_dim, self.prefill_chunk,
                                spare_rows(self.kv_layout, self.format_version), self.kv_dtype,
                                self.format_version >= COVER_SINCE, self.sliding_cache)

    @property
    def n_layers(self) -> int:
        return self.dims.n_layers

    @property
    def n_kv_heads(self) -> int:
        return self.dims.n_kv_heads

    @property
    def head_dim(self) -> int:
        """The width of a cache row (what KVCache allocates): the model's head size, or `kv_head_dim`."""
        return self.dims.head_dim

    @property
    def model_head_dim(self) -> int:
        """The model's head size; `head_dim` is the cache's (larger for zero-padded heads, `kv_head_dim`)."""
        return self.dims.model_head_dim

    @property
    def dim(self) -> int:
        return self.dims.dim

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def add_bos(self) -> bool:
        """Whether text prompts get `bos_id` in front (token-id prompts never do)."""
        return self.tokenizer is not None and self.tokenizer["add_bos"]

    @property
    def has_stack(self) -> bool:
        return any(g.role == "stack" for g in self.graphs)

    @property
    def has_lone_stack(self) -> bool:
        """A `stack_lone` graph (format 13): the stack without the spare attention row (edgellm/layout/lone.py)."""
        return any(g.role == "stack_lone" for g in self.graphs)

    def graph(self, role: str, seq: int, layer: int | None = None) -> GraphSpec:
        for g in self.graphs:
            if (g.role, g.seq, g.layer) == (role, seq, layer):
                return g
        raise EdgeError(f"manifest: no {role} graph with seq={seq}" + (f", layer={layer}" if layer is not None else ""))

    def validate(self) -> None:
        """Cross-field checks; types are checked when parsing JSON."""
        need(self.granularity in ROLES_BY_GRANULARITY, f"granularity: expected 'layer' or 'model', got {self.granularity!r}")
        need(self.kv_layout in KV_LAYOUTS, f"kv_layout: expected one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        need(self.kv_layout == "rows" or self.granularity == "layer",
             f"kv_layout: {self.kv_layout!r} needs granularity 'layer', got {self.granularity!r}")
        need(self.kv_head_dim is None or self.kv_layout == "inplace",
             f"kv_head_dim: zero-padded heads exist in kv_layout 'inplace' only, got {self.kv_layout!r}")
        need(self.max_seq >= 1, f"max_seq: expected >= 1, got {self.max_seq}")
        need(self.format_version in READS, f"format_version: expected one of {READS}, got {self.format_version!r}")
        need(self.logit_columns is None or self.format_version >= COLUMNS_SINCE,
             f"logit_columns: needs format_version {COLUMNS_SINCE}, this manifest says {self.format_version}")
        need(self.logit_columns is None or self.logit_columns in self.files,
             f"logit_columns: {self.logit_columns!r} is not listed in files")
        need(not self.has_lone_stack or self.format_version >= LONE_SINCE,
             f"graphs: stack_lone needs format_version {LONE_SINCE}, this manifest says {self.format_version}")
        need(not self.has_lone_stack or self.has_stack,
             "graphs: a stack_lone graph needs the stack graph it leaves a row out of")
        need(self.kv_dtype == "float32" or self.format_version >= KV_DTYPE_SINCE,
             f"kv_dtype: {self.kv_dtype!r:.40} needs format_version {KV_DTYPE_SINCE}, this manifest says "
             f"{self.format_version}")
        need(self.kv_dtype != "int8" or self.format_version >= KV_INT8_SINCE,
             f"kv_dtype: 'int8' needs format_version {KV_INT8_SINCE}, this manifest says {self.format_version}")
        need(self.sliding_cache == "ring" or self.format_version >= COVER_SINCE,
             f"sliding_cache: {self.sliding_cache!r:.40} needs format_version {COVER_SINCE}, this manifest says "
             f"{self.format_version}")
        need(self.sliding_cache == "ring" or self.kv_layout == "inplace",
             f"sliding_cache: {self.sliding_cache!r:.40} is written by the fused layers only (kv_layout 'inplace')")
        need(self.logit_columns is None or self.granularity == "layer",
             "logit_columns: only a head graph (granularity 'layer') computes its logits in another order")
        rows = self.dims.rows if any(r != self.max_seq for r in self.dims.rows) else None
        need(self.kv_cache_rows == rows, f"kv_cache_rows: expected {list(rows) if rows else None} (the config's "
                                         f"sliding-window layers at max_seq {self.max_seq}), got "
                                         f"{list(self.kv_cache_rows) if self.kv_cache_rows else None}")
        need(1 <= self.prefill_chunk <= self.max_seq,
             f"prefill_chunk: expected 1..max_seq={self.max_seq}, got {self.prefill_chunk}")
        need(self.opset >= 1, f"opset: expected >= 1, got {self.opset}")
        dims = self.dims
        need(MANIFEST not in self.files, f"files: must not list {MANIFEST} itself")
        for rel, spec in self.files.items():
            need(bool(_SHA256.fullmatch(spec.sha256)), f"files[{rel!r}].sha256: expected 64 lowercase hex digits")
            need(spec.bytes >= 0, f"files[{rel!r}].bytes: expected >= 0, got {spec.bytes}")
        check_graphs(self.graphs, self.granularity, self.kv_layout, self.prefill_chunk, self.files, dims)
        if self.tokenizer is not None:
            check_tokenizer(self.tokenizer, self.files, self.bos_id)
        for key in ("bos_id", "eos_id"):
            tok = getattr(self, key)
            need(tok is None or 0 <= tok < dims.vocab_size, f"{key}: expected 0..{dims.vocab_size - 1}, got {tok}")
        for i, tok in enumerate(self.eos_ids):
            need(is_int(tok) and 0 <= tok < dims.vocab_size,
                 f"eos_ids[{i}]: expected 0..{dims.vocab_size - 1}, got {tok!r}")
        need(len(set(self.eos_ids)) == len(self.eos_ids), f"eos_ids: duplicate ids in {list(self.eos_ids)}")
        need(self.eos_ids[:1] == ((self.eos_id,) if self.eos_id is not None else ()),
             f"eos_ids: expected eos_id ({self.eos_id}) first and no ids without it, got {list(self.eos_ids)}")
        SamplingParams.from_dict(self.sampler, "sampler")
        for name, diff in self.verification.items():
            need(diff >= 0, f"verification[{name!r}]: expected a max |diff| >= 0, got {diff}")

    def to_json(self) -> str:
        fields = asdict(self)  # in design.md order
        if self.format_version < COLUMNS_SINCE:  # (None: validate) an older format's keys are exact
            del fields["logit_columns"]
        if self.format_version < KV_DTYPE_SINCE:  # ("float32": validate)
            del fields["kv_dtype"]
        if self.format_version < COVER_SINCE:  # ("ring": validate)
            del fields["sliding_cache"]
        doc = {"format": FORMAT, "format_version": fields.pop("format_version"), **fields}
        try:
            text = json.dumps(doc, indent=2, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise EdgeError(f"manifest: cannot be written as JSON: {err}") from None
        # one line per shape: a raw newline never occurs inside a JSON string, so only real arrays match
        return re.sub(rf"\[\n\s*({_NUM}(?:,\n\s*{_NUM})*)\n\s*\]",
                      lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"

    def write(self, directory: Path) -> Path:
        """Check the listed files exist with their sizes, then write manifest.json atomically (it goes last)."""
        directory = Path(directory)
        check_files(directory, self.files, hash_files=False)
        path = directory / MANIFEST
        atomic_write_text(path, self.to_json())
        return path

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate (no file checks). EdgeError names the key at fault, never KeyError."""
        from .manifest_json import no_constant, parse  # (it builds Manifests: imported once this module is)

        try:
            doc = json.loads(text, parse_constant=no_constant)
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise EdgeError(f"not valid JSON ({err})") from None
        return parse(doc)


def read_manifest(directory: Path, verify: bool = True) -> Manifest:
    """Read and check `directory/manifest.json`; sizes are always checked, sha256 too when `verify`."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        need(path.stat().st_size <= _MAX_MANIFEST_BYTES, f"{path}: larger than {_MAX_MANIFEST_BYTES} bytes")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise EdgeError(f"{path}: not found (expected an edgellm export directory)") from None
    except OSError as err:
        raise EdgeError(f"{path}: cannot read ({err.strerror})") from None
    try:
        manifest = Manifest.from_json(raw)
        check_files(directory, manifest.files, hash_files=verify)
    except EdgeError as err:
        raise EdgeError(f"{path}: {err}") from None
    return manifest
