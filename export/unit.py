"""Export one unit: trace its variants, write the shared data file, check the graphs, verify in onnxruntime."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch

from edgellm import __version__
from edgellm.model import Decoder
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import sha256_file
from edgellm.runtime.graphio import Dims

from .datafile import DataFile, Ref
from .fused import build_layer, rope_tables
from .graphs import Unit, example_inputs
from .journal import UnitRecord
from .options import ExportOptions
from .rewrite import check_io, matmul_weights, op_counts, rsqrt_to_div
from .trace import fold_weight_transposes, name_weights, strip_metadata, trace_graph
from .verify import verification_past_len, verify_graph

ROPE_DATA = "rope.data"  # the fused layers' RoPE tables: one copy for the model, not one per layer_{i}.data


@dataclass(frozen=True)
class RopeTables:
    """The fused layers' RoPE tables, computed once per export and written once, to rope.data, before any layer:
    each layer's data file finds them there (`refs`, its `known`) and points at that copy. SmolLM2-135M at
    max_seq 512: 30 per-layer copies, 3.9 MB, became one of 0.13 MB."""

    tables: dict[bool, tuple[np.ndarray, ...]]  # sliding-window (local) layer? -> fused.rope_tables(...)
    refs: dict[str, Ref]                        # content key -> where rope.data holds it

    def of(self, model: Decoder, layer: int) -> tuple[np.ndarray, ...]:
        return self.tables[model.cfg.window(layer) is not None]


def write_rope_tables(model: Decoder, directory: Path, max_seq: int) -> RopeTables:
    """Compute the tables (Gemma 3: a global and a local one) and write `directory/rope.data` (no file when
    the model has no RoPE)."""
    cfg = model.cfg
    tables = {local: rope_tables(model, max_seq, local)
              for local in sorted({cfg.window(i) is not None for i in range(cfg.n_layers)})}
    data = DataFile(directory, ROPE_DATA)
    try:
        for array in chain.from_iterable(tables.values()):
            data.put(array)
    finally:
        data.close()
    return RopeTables(tables, data.index)


def variant_seqs(options: ExportOptions) -> list[int]:
    """S of each variant: prefill then decode (one variant when the chunk is 1)."""
    return [options.prefill_chunk, 1] if options.prefill_chunk > 1 else [1]


def export_unit(model: Decoder, unit: Unit, directory: Path, dims: Dims, options: ExportOptions,
                known: dict[str, Ref], done: Callable[[str], None], rope: RopeTables | None = None) -> UnitRecord:
    """Write `<stem>.{prefill,decode}.onnx` + `<stem>.data` into `directory`; raise EdgeError on a mismatch.

    `known` holds tensors already in other units' data files (the tied table in head.data); `done(name)` is
    called after each graph is written and verified (progress). `rope`: the tables a fused layer reads, already
    in rope.data (a fused layer's graphs point into its own data file and rope.data).
    """
    weights = {n: t for n, t in chain(model.named_parameters(), model.named_buffers())
               if n.startswith(unit.weight_prefixes)}
    fused = unit.role == "layer" and dims.kv_layout == "inplace"  # hand-built from fused kernels
    need(not fused or rope is not None, f"internal: {unit.stem}: a fused layer needs the export's RoPE tables")
    data = DataFile(directory, f"{unit.stem}.data", {**known, **rope.refs} if fused else known)
    graphs, ops, matmuls = [], {}, {}
    tables = rope.of(model, unit.layer) if fused else ()
    try:
        for seq in variant_seqs(options):
            name, file, _, inputs, outputs = unit.graph(seq, dims)
            if fused:
                model_ir, names = build_layer(model, unit.layer, seq, tables, inputs, outputs, options.opset,
                                              dims.ring(unit.layer))
            else:
                trace_in = example_inputs(inputs, dims, torch.Generator().manual_seed(0), 0)
                model_ir = trace_graph(unit.module, trace_in, [o.name for o in outputs], options.opset, name)
                fold_weight_transposes(model_ir)
                strip_metadata(model_ir)
                names = name_weights(model_ir, weights)
            data.externalize(model_ir, names)
            proto = ir.to_proto(model_ir)
            del model_ir  # drops the exporter's folded weight copies
            rsqrt_to_div(proto.graph)
            check_io(proto, inputs, outputs, name)
            matmuls[name] = len(matmul_weights(proto, name))
            ops[name] = op_counts(proto)
            proto.doc_string = f"edgellm {__version__} export: {name}"
            onnx.save_model(proto, directory / file)
            graphs.append((name, file, inputs, outputs))
        for tensor in unit.carried:  # for a later unit's graphs (graphs.Unit.carried), referenced by content
            data.put(tensor.to(torch.float32).numpy())
    finally:
        data.close()
    own = data.used - {ROPE_DATA}
    need(len(own) <= 1, f"{unit.stem}: graphs point into several data files {sorted(own)}")

    verification = {}
    gen = torch.Generator().manual_seed(options.seed * 1_000_003 + zlib.crc32(unit.stem.encode()))
    for name, file, inputs, outputs in graphs:
        try:
            onnx.checker.check_model(str(directory / file))  # by path, so external data is checked too
        except onnx.checker.ValidationError as err:
            raise EdgeError(f"{directory / file}: onnx checker: {str(err).splitlines()[0]}") from None
        past_len = verification_past_len(options.max_seq, inputs[0].shape[1], gen)
        feeds = example_inputs(inputs, dims, gen, past_len)
        diff = verify_graph(directory / file, unit.reference, feeds, [o.name for o in outputs],
                            in_place=dims.kv_layout == "inplace" and unit.role == "layer")
        need(diff <= options.tolerance, f"{name}: onnxruntime differs from PyTorch by {diff:.3g} > --atol "
                                        f"{options.tolerance:g} (seeded inputs, past_len={past_len})")
        verification[name] = diff
        done(name)
    files = [file for _, file, _, _ in graphs] + sorted(data.used)
    return UnitRecord(files={rel: sha256_file(directory / rel) for rel in files},
                      data=next(iter(own), None),
                      tensors={k: [r.file, r.offset, r.length] for k, r in data.index.items()},
                      verification=verification, ops=ops, matmul_weights=matmuls)
