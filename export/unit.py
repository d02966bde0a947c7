"""Export one unit: trace its variants, write the shared data file, check the graphs, verify in onnxruntime."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from itertools import chain
from pathlib import Path

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


def variant_seqs(options: ExportOptions) -> list[int]:
    """S of each variant: prefill then decode (one variant when the chunk is 1)."""
    return [options.prefill_chunk, 1] if options.prefill_chunk > 1 else [1]


def export_unit(model: Decoder, unit: Unit, directory: Path, dims: Dims, options: ExportOptions,
                known: dict[str, Ref], done: Callable[[str], None]) -> UnitRecord:
    """Write `<stem>.{prefill,decode}.onnx` + `<stem>.data` into `directory`; raise EdgeError on a mismatch.

    `known` holds tensors already in other units' data files (the tied table in head.data); `done(name)` is
    called after each graph is written and verified (progress).
    """
    weights = {n: t for n, t in chain(model.named_parameters(), model.named_buffers())
               if n.startswith(unit.weight_prefixes)}
    data = DataFile(directory, f"{unit.stem}.data", known)
    graphs, ops, matmuls = [], {}, {}
    fused = unit.role == "layer" and dims.kv_layout == "inplace"  # hand-built from fused kernels
    tables = rope_tables(model, dims.max_seq, model.cfg.window(unit.layer) is not None) if fused else ()
    try:
        for seq in variant_seqs(options):
            name, file, _, inputs, outputs = unit.graph(seq, dims)
            if fused:
                model_ir, names = build_layer(model, unit.layer, seq, tables, inputs, outputs, options.opset)
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
    need(len(data.used) <= 1, f"{unit.stem}: graphs point into several data files {sorted(data.used)}")

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
        need(diff <= options.atol, f"{name}: onnxruntime differs from PyTorch by {diff:.3g} > --atol "
                                   f"{options.atol:g} (seeded inputs, past_len={past_len})")
        verification[name] = diff
        done(name)
    files = [file for _, file, _, _ in graphs] + sorted(data.used)
    return UnitRecord(files={rel: sha256_file(directory / rel) for rel in files},
                      data=next(iter(data.used), None),
                      tensors={k: [r.file, r.offset, r.length] for k, r in data.index.items()},
                      verification=verification, ops=ops, matmul_weights=matmuls)
