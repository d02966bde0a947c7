"""Where each graph's weights live: pre-packed by onnxruntime, or read in place from one shared map.

The prefill (S = prefill_chunk) and decode (S = 1) variants of a graph use the same weights, but
onnxruntime cannot share a pre-packed copy between two sessions from Python. So the weights are held once:

- layer granularity: a decode graph is pre-packed (onnxruntime loads its data file itself and drops its
  map once packed: one private copy), unless its own data file (the manifest's `data`) is also read by a graph
  of another unit (an embed graph whose table a layer graph also reads). rope.data, which every fused layer also
  reads, holds no weight to pack and does not count. The head is always pre-packed, a tied table included (the
  embed graph then gathers its rows from the map, released like any lookup table): read in place, onnxruntime's
  float MatMul runs one row as a matrix-vector product but S > 1 rows (speculative verification) through the
  packed kernel, re-packing the whole table per call (SmolLM2-135M's 576 x 49152 head: 10.5 ms at 9 rows
  against 4.2 ms pre-packed) and summing in another order, so a verification row was not bit for bit its
  decode step. Steady RSS is the same either way (one copy, anonymous instead of file pages: 646 vs 647 MB
  on SmolLM2 fp32); loading peaks ~90 MB higher while the table is packed. An fp32
  prefill graph reads its weights in place from the shared map, unpacked, and its pages are released right
  after each of its runs (`SharedWeights.release`: madvise DONTNEED, the file stays in the page cache), so RSS
  holds one layer's unpacked weights at a time on top of the packed ones. A quantized prefill graph is
  pre-packed too: its kernels are many times slower unpacked, and its packed copy is small.
- model granularity: one graph holds every weight, so no page can be released between layers: fp32 graphs
  read everything in place, unpacked (one copy); quantized graphs pre-pack both variants (their kernels need
  the packed layout), i.e. two copies of the (small) quantized weights.

A paired graph (both variants of a layer in one file, quantize's default) is one session,
placed like a decode graph: one packed copy serves both, and `--prefill-weights` does not apply to it. The
stack (embedding + every layer, paired; written by export and quantize) is always pre-packed: an Engine that
runs it opens no layer graph, and the one file it may share with the head is the tied embedding table, which
it reads as a lookup table (below). Only the graphs an Engine opens count as readers: the stack's, or the
embed and layer graphs', and the head's.

Lookup tables (initializers a graph reads only as a Gather's table: the embedding) always come from the
shared map, pre-packed graph or not, mapped a page per row read (`weightmap._small_pages`: else the kernel maps
the page-cache folio around each row, up to 2 MB with large folios, and a prefill made most of the table
resident at once: Qwen2.5-0.5B int4 peak RSS 590 -> 530 MB), and their files are released every few steps
(`Engine`), so a mapped table does not grow the RSS with every new token. Unless another graph reads the
file in place (an unpacked prefill graph of a layer that shares the file), which keeps it resident anyway.

`SessionConfig.prepack_prefill` (`--prefill-weights`) overrides the prefill choice: True pre-packs every
prefill graph (faster prefill, a second copy in RAM), False none (lowest RSS, slower prefill); None (default)
is the rule above. Quantized decode graphs are always pre-packed (MatMulNBits is many times slower unpacked).
The measurements behind each choice: docs/benchmarks.md, "Runtime design measurements".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import EdgeError
from .fileio import safe_join
from .graphio import STACK_ROLES
from .manifest import GraphSpec, Manifest
from .onnxmeta import GraphInfo, read_graph_info

# ops whose kernels pre-pack their weights into a layout they need (DequantizeLinear + MatMul is fused into
# MatMulNBits when the session is created)
QUANTIZED_OPS = frozenset({"MatMulNBits", "DequantizeLinear", "MatMulInteger", "QLinearMatMul",
                           "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "GatherBlockQuantized"})


@dataclass(frozen=True)
class Placement:
    info: GraphInfo
    prepack: bool                # onnxruntime pre-packs (and loads the data itself, lookup tables aside)
    release: tuple[str, ...]     # data files (relative paths) to release from RSS after each run
    tables: tuple[str, ...] = ()  # lookup-table files (read only by Gather) to release every few runs
    # data files holding the packed-once constants of a pre-packed graph (GraphInfo.packed_consts: float32
    # MatMulNBits scales, the block-offset term's weights), released once its session is open:
    # onnxruntime copies them into the packed weights yet keeps the initializer for the session's life (its own
    # map of the file, or the float32 copy it folds an fp16 scale's Cast into); from the shared map their pages
    # leave the RSS once packed (and come back from the file, should a kernel read them again)
    packed_files: tuple[str, ...] = ()

    @property
    def mapped(self) -> frozenset[str]:
        """The external initializers the runtime hands this graph's session from its shared maps: all of them
        when the graph reads its weights in place; when it pre-packs, the lookup tables (Gather's) and the
        constants onnxruntime packs once (`packed_files`)."""
        if not self.prepack:
            return frozenset(t.name for t in self.info.external)
        return self.info.gathered | self.info.packed_consts


def _unit(spec: GraphSpec) -> tuple[str, int | None]:
    """The unit a graph variant belongs to (both variants of one layer are one unit): from the manifest's
    role and layer, not from its name."""
    return spec.role, spec.layer


def check_external_data(directory: Path, spec: GraphSpec, info: GraphInfo) -> None:
    """Every external-data file of a graph lies inside the export and is readable — checked here, before
    onnxruntime opens anything (it would resolve the path itself, and log its own multi-line errors)."""
    folder = PurePosixPath(spec.file).parent
    for rel in sorted({t.location for t in info.external}):
        path = safe_join(directory, str(folder / rel))
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise EdgeError(f"{path}: cannot read the weights of {spec.file} ({err.strerror or err})") from None


def plan(directory: Path, manifest: Manifest, prepack_prefill: bool | None, stacked: bool,
         stack: str = "stack") -> dict[str, Placement]:
    """Graph name -> Placement, for every graph an Engine opens: the head and the stack graph of role `stack`
    if `stacked` (variant.runs_stack, variant.stack_role), else every graph but the stacks."""
    infos = {g.name: read_graph_info(safe_join(directory, g.file)) for g in manifest.graphs}
    for g in manifest.graphs:  # all of them: an export whose unopened graphs are broken is broken
        check_external_data(directory, g, infos[g.name])
    graphs = [g for g in manifest.graphs
              if g.role == "head" or (g.role == stack if stacked else g.role not in STACK_ROLES)]
    files = {g.name: {t.location for t in infos[g.name].external} for g in graphs}
    readers: dict[str, set[tuple[str, int | None]]] = {}  # data file -> units whose graphs read it
    for g in graphs:
        for rel in files[g.name]:
            readers.setdefault(rel, set()).add(_unit(g))
    layered = manifest.granularity == "layer"
    prepack: dict[str, bool] = {}
    for g in graphs:
        quantized = bool(infos[g.name].op_types & QUANTIZED_OPS)
        if g.role in STACK_ROLES:
            prepack[g.name] = True
        elif g.seq > 1 and not g.paired:  # a paired prefill variant shares its decode variant's session
            prepack[g.name] = quantized if prepack_prefill is None else prepack_prefill
        elif layered and g.role == "head":
            prepack[g.name] = True
        elif layered:
            shared = g.data is not None and len(readers.get(g.data, ())) > 1
            prepack[g.name] = quantized or not shared
        else:
            prepack[g.name] = quantized
    # files some unpacked decode graph keeps reading in place, other than as a lookup table, stay resident
    kept = {t.location for g in graphs if g.seq == 1 and not prepack[g.name]
            for t in infos[g.name].external if t.name not in infos[g.name].gathered}
    out = {}
    for g in graphs:
        info = infos[g.name]
        resident = prepack[g.name] or g.seq == 1 or g.paired or not layered
        release = set() if resident else files[g.name] - kept
        # files the graph reads only by Gather (an embedding table): see the module docstring
        tables = files[g.name] - {t.location for t in info.external if t.name not in info.gathered} - kept
        folder = PurePosixPath(g.file).parent
        packed = {str(folder / t.location) for t in info.external if t.name in info.packed_consts}
        out[g.name] = Placement(info, prepack[g.name], tuple(sorted(release)), tuple(sorted(tables - release)),
                                tuple(sorted(packed)) if prepack[g.name] else ())
    return out
