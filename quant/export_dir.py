"""`quantize_export`: an fp32 export directory -> a NEW quantized export directory (the input is only read).

Per unit (head, embed, layer_i | model), both variants: load the graph with its weights, rewrite it
(`quantize_model`, then the tied embedding lookup), drop what no node reads, and move the big initializers
into the unit's data file (`DataStore`: content-keyed, so the decode variant and a shared tied table add no
bytes; rope.data, the layers' one copy of the RoPE tables, is copied as it is and still read there). `fast`
exports of in-place layers then write each layer's two variants as one paired graph
(edgellm/layout/pairing.py: one graph, S symbolic; manifest format 5), and the embedding and all layers once more as one
paired stack graph that reads the same data files (edgellm/layout/stacking.py). The plan's memo quantizes each weight once; it is kept from the head into
the embedding unit (a tied table) and cleared after, so memory stays at one unit's weights. Then: tokenizer
copied, every file hashed, an optional check of the logits against the fp32 export, manifest.json written
last, and the directory renamed into place (`atomic_dir`): a crash leaves no half-written output.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
from tqdm import tqdm

from edgellm import __version__
from edgellm.layout.kv_fp16 import fp16_cache
from edgellm.layout.pairing import pair_layer
from edgellm.layout.stacking import write_stack
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import atomic_dir, describe_files, safe_join
from edgellm.runtime.graphio import STACK_ROLES
from edgellm.runtime.manifest import (
    COLUMNS_SINCE,
    LONE_SINCE,
    MANIFEST,
    GraphSpec,
    Manifest,
    read_manifest,
)
from edgellm.runtime.tokenizer import copy_tokenizer

from . import grids, kv_cache, kv_int8, mixed
from .awq import Migrator
from .calibrate import Calibration, calibrate
from .headsplit import HeadSplit, plan_split, split_head
from .onnxedit import load_graph, prune_initializers
from .options import QuantizeOptions, logical_name, unmatched_keeps
from .plan import QuantPlan, WeightReport, WeightSite
from .record import check_export, quantization_record, site
from .report import LogitComparison
from .rewrite import quantize_model
from .storage import DataStore, Ref, copy_shared
from .tied import quantize_tied_gathers

COLUMNS_FILE = "logit_columns.i32"   # a split head's column -> token id map (runtime/columns.py)
# a split head needs format 12's logit_columns; 10 and 11 differ from 12 in nothing a quantized export keeps
# (8-9: no spare cache row, which the version number tells the runtime, so they cannot be relabelled)
SPLIT_SINCE = 10


@dataclass
class QuantizeResult:
    manifest: Manifest
    weights: list[tuple[str, WeightReport]]    # (display name, report), one per weight use
    files_before: int                          # bytes of all files of the input / output export
    files_after: int
    check: LogitComparison | None
    calibration: Calibration | None


def _stderr(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def _check_paths(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    need(s != o, f"-o {out}: is the input export itself; the input is never modified, choose a new directory")
    need(not o.is_relative_to(s), f"-o {out}: is inside the input export {src}; choose a directory outside it")
    need(not s.is_relative_to(o), f"-o {out}: contains the input export {src}; replacing it would delete the input")
    need(not out.exists() or out.is_dir(), f"-o {out}: exists and is not a directory")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    need(parent.is_dir(), f"-o {out}: cannot create the output directory ({parent} is not a directory)")  # before calibrating
    need(not out.exists() or (out / MANIFEST).is_file() or not any(out.iterdir()),
         f"-o {out}: exists and holds no {MANIFEST}; refusing to replace it (choose a new or empty directory)")


def _units(manifest: Manifest) -> list[tuple[str, list[GraphSpec]]]:
    """(stem, its graphs) in write order: the head before the embedding that may read its table."""
    order = {"model": 0, "head": 0, "embed": 1, "layer": 2}
    units: dict[str, list[GraphSpec]] = {}
    for g in sorted(manifest.graphs, key=lambda g: (order[g.role], g.layer or 0, -g.seq)):
        units.setdefault(f"layer_{g.layer}" if g.role == "layer" else g.role, []).append(g)
    return list(units.items())


def _display_order(item: tuple[str, WeightReport]) -> tuple[int, int]:
    """Embedding, then layer by layer (graph order within a layer: sorted() is stable), then the head."""
    name, r = item
    if r.op == "Gather":
        return (0, 0)
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]))
    return (2, 0)


def _candidate_sites(src: Path, manifest: Manifest) -> list[WeightSite]:
    """The weights a plan may see, read from the graphs alone (no weight data): matmul Bs and Gather tables."""
    sites = []
    for g in manifest.graphs:
        if g.seq != manifest.prefill_chunk:
            continue
        graph = load_graph(safe_join(src, g.file), False).graph
        tables = {t.name for t in graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT}
        for n in graph.node:
            op = "Gather" if n.op_type == "Gather" else "MatMul"
            name = n.input[0] if op == "Gather" else (n.input[1] if len(n.input) > 1 else "")
            if n.op_type in ("MatMul", "Gemm", "Gather") and name in tables:
                sites.append(WeightSite(name, op, n.name, name.removesuffix(".weight"), (0, 0)))
    return sites


def quantize_export(src: Path, out: Path, options: QuantizeOptions, *, check: bool = True,
                    progress: bool = True, log: Callable[[str], None] = _stderr,
                    calibration: Calibration | None = None) -> QuantizeResult:
    """`calibration`: reuse one made by an earlier call (--kl-budget tries several variants on the same)."""
    src, out = Path(src), Path(out)
    need(src.is_dir(), f"{src}: not a directory (expected an edgellm export directory)")
    manifest = read_manifest(src)
    need(manifest.quantization is None, f"{src}: already quantized; quantize the fp32 export instead")
    # the source's stack graph is not quantized: a fast export gets a new one built from its quantized graphs
    manifest = dataclasses.replace(manifest, graphs=tuple(g for g in manifest.graphs if g.role not in STACK_ROLES))
    _check_paths(src, out)
    options.validate(manifest.n_layers)
    sites = _candidate_sites(src, manifest)
    missing = unmatched_keeps(options, sites)     # a typo fails before any work
    if missing:
        raise EdgeError(f"{missing[0]}: matches no weight (module paths look like "
                        f"layers.0.attn.qkv, layers.0.mlp.down, lm_head, embed)")
    options = grids.resolve(src, manifest, options, log)    # --block-min auto: on or off, a grid kept
    choose = options.chooser(manifest.n_layers)
    for candidate in sites:  # a rule that cannot apply to a weight (--group P=0 on block minima) fails here too
        choose(candidate)
    need(not options.split_head or manifest.format_version >= SPLIT_SINCE,
         f"{src}: --lm-head-int8-rows: an export of format {manifest.format_version} cannot carry a split head "
         f"(format {SPLIT_SINCE} or later; re-export it, or pass --lm-head-int8-rows 1)")
    kv_dtype = kv_cache.cache_type(src, manifest, options)
    calib = calibration if options.calibrated else None
    hessians = options.method == "gptq" or options.int8_fraction > 0
    if options.calibrated and (calib is None or (hessians and not calib.hessians)):
        with tqdm(total=options.calibration_tokens, desc="calibrate", unit="tok", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            calib = calibrate(src, manifest, options.calibration_tokens, options.seed, bar.update, hessians,
                              options.calibration_text)
        log(f"calibration: {calib.tokens} tokens in {calib.sequences} sequences, {calib.to_dict()['source']}")
    promoted = _promotions(src, manifest, options, calib, progress, log) if options.int8_fraction else frozenset()
    tied = frozenset({"embed.weight"}) if manifest.config.get("tie_embeddings") else frozenset()
    head = WeightSite("embed.weight" if tied else "lm_head.weight", "MatMul", "", "lm_head", (0, 0))
    kept = options.chooser(manifest.n_layers, promoted)(head) is None          # `--keep lm_head`: nothing to split
    split = plan_split(src, manifest, calib.samples, options.head_int8_rows, options.low_rows_spec().scheme) \
        if options.split_head and calib is not None and not kept else None
    if split is not None and tied:
        tied = split.parts
    plan = options.plan(manifest.n_layers, calib.act_scales if calib else None,
                        calib.hessians if calib and options.method == "gptq" else None, promoted, tied)
    migrator = Migrator(plan, calib) if calib is not None and options.method == "awq" else None
    kv_scales = kv_int8.calibrated(src, manifest, options, progress, calib) if kv_dtype == "int8" else None
    source, manifest = manifest, kv_cache.with_cache(manifest, kv_dtype) if kv_dtype else manifest
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty directory the user made for us: atomic_dir replaces only earlier exports
    with atomic_dir(out, marker=MANIFEST) as tmp:
        paired = options.format == "fast" and manifest.kv_layout == "inplace" and manifest.prefill_chunk > 1
        shared = copy_shared(src, manifest.graphs, tmp)   # rope.data: read by every layer, copied as it is
        graphs, reports = _rewrite_all(src, tmp, manifest, plan, migrator, progress, paired, shared, split,
                                       kv_dtype, kv_scales)
        names = sorted(((logical_name(site(r)), r) for r in reports.values()), key=_display_order)
        rels = list(dict.fromkeys(g.file for g in graphs)) + sorted({g.data for g in graphs if g.data}
                                                                   | {r.file for r in shared.values()})
        if manifest.tokenizer is not None:  # the tokenizer file (a tokenizer.json minified) and chat template
            tok, template = manifest.tokenizer["file"], manifest.tokenizer["chat_template"]
            copy_tokenizer(safe_join(src, tok), tmp / tok, manifest.tokenizer["kind"])
            if template is not None:
                shutil.copyfile(safe_join(src, template), tmp / template)
            rels += [tok] + ([template] if template is not None else [])
        columns = None
        if split is not None:  # the split head's logits come in split order (manifest format 12)
            columns = COLUMNS_FILE
            (tmp / columns).write_bytes(split.columns.astype("<i4").tobytes())
            rels.append(columns)
        files = describe_files(tmp, rels)
        opset = max(_opset(tmp / g.file) for g in graphs)
        version = max(COLUMNS_SINCE, manifest.format_version) if columns else manifest.format_version
        if any(g.role == "stack_lone" for g in graphs):  # written with the stack of a spare-row export (lone.py)
            version = max(LONE_SINCE, version)
        new = dataclasses.replace(manifest, edgellm_version=__version__, graphs=tuple(graphs), files=files,
                                  opset=opset, quantization={}, verification={}, logit_columns=columns,
                                  format_version=version)
        comparison, stack_checks = check_export(src, source, tmp, new, options.seed) if check else (None, {})
        record = quantization_record(options, plan, names, calib, comparison, source, src,
                                     migrator.alpha if migrator else {}, kv_scales)
        verification = {"end_to_end_vs_fp32": comparison.max_abs_diff} if comparison else {}
        verification |= stack_checks
        new = dataclasses.replace(new, quantization=record, verification=verification)
        new.write(tmp)
    before = sum(f.bytes for f in source.files.values())
    after = sum(f.bytes for f in new.files.values())
    return QuantizeResult(new, names, before, after, comparison, calib)


def _promotions(src: Path, manifest: Manifest, options: QuantizeOptions, calib: Calibration | None,
                progress: bool, log: Callable[[str], None]) -> frozenset[str]:
    """`--int8-fraction`: the int4 linears promoted to int8 by measured sensitivity (mixed.py)."""
    need(calib is not None and bool(calib.hessians), "--int8-fraction: internal error, no calibration Hessians")
    chooser, base = options.chooser(manifest.n_layers), options.linear_spec()
    low, high = base.scheme, options.promoted_spec().scheme

    def eligible(site: WeightSite) -> bool:
        return chooser(site) == base
    with tqdm(total=len(manifest.graphs) // 2, desc="sensitivity", unit="graph", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        found = mixed.measure(src, manifest, calib.hessians, low, high, eligible, bar.update)  # type: ignore[union-attr]
    chosen = mixed.choose(found, options.int8_fraction)
    log(f"--int8-fraction {options.int8_fraction}: {len(chosen)} of {len(found)} linears int8 by measured "
        f"sensitivity: {', '.join(sorted(n.removesuffix('.weight') for n in chosen)) or 'none'}")
    return chosen


def _rewrite_all(src: Path, tmp: Path, manifest: Manifest, plan: QuantPlan, migrator: Migrator | None,
                 progress: bool, paired: bool,
                 shared: dict[str, Ref], split: HeadSplit | None, kv_dtype: str | None, kv_scales: list | None,
                 ) -> tuple[list[GraphSpec], dict[tuple[str, str], WeightReport]]:
    """Every graph quantized into `tmp`; with `paired`, each layer's two variants written as one graph
    (edgellm/layout/pairing.py: one session, one packed copy of the weights at run time). `shared`: tensors
    already in `tmp`'s copy of rope.data (copy_shared), pointed at there. `split`: the head's rows split
    (headsplit.py) in every graph reading its table, after AWQ (which leaves an int8 head alone). `kv_dtype`:
    every layer graph's cache made fp16 (kv_cache.py), or int8 with the scales `kv_scales` (kv_int8.py)."""
    store = DataStore(tmp, shared)
    graphs: list[GraphSpec] = []
    stackable: dict[int, list[onnx.ModelProto]] = {}  # S -> embed then layer graphs (in _units order)
    reports: dict[tuple[str, str], WeightReport] = {}     # (initializer, op) -> first report
    try:
        with tqdm(total=len(manifest.graphs), desc="quantize", unit="graph", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            for stem, specs in _units(manifest):
                done: list[tuple[GraphSpec, onnx.ModelProto]] = []
                for g in specs:
                    bar.set_postfix_str(g.name)
                    model = load_graph(safe_join(src, g.file), True)
                    if migrator is not None:
                        migrator.apply(model)          # AWQ scales, searched on the first variant
                    if split is not None:
                        split_head(model, split.table, split.hi)
                    found = quantize_model(model, plan) + quantize_tied_gathers(model, plan)
                    if kv_scales:
                        kv_int8.int8_cache(model, kv_scales)
                    elif kv_dtype == "float16":
                        fp16_cache(model)
                    prune_initializers(model.graph)
                    done.append((dataclasses.replace(g, data=store.place(model, f"{stem}.data")), model))
                    for r in found:
                        reports.setdefault((r.name, "Gather" if r.op == "Gather" else "MatMul"), r)
                    bar.update()
                if paired and specs[0].role in ("embed", "layer"):
                    for g, model in done:
                        stackable.setdefault(g.seq, []).append(model)
                # the head too (format 9: one session for S = 1 and verification rows), unless the fp32
                # export's head is paired already (then both entries name one file, rewritten alike)
                if paired and specs[0].role in ("layer", "head") and len(done) == 2 and not specs[0].paired:
                    (p, pm), (d, dm) = sorted(done, key=lambda x: -x[0].seq)
                    (tmp / f"{stem}.onnx").write_bytes(pair_layer(pm, dm).SerializeToString())
                    done = [(dataclasses.replace(g, file=f"{stem}.onnx", paired=True), None) for g in (p, d)]
                for g, model in done:
                    if model is not None:
                        (tmp / g.file).write_bytes(model.SerializeToString())
                    graphs.append(g)
                del done
                if stem != "head":     # the embedding unit after the head may still need its tied table
                    plan.memo.clear()
    finally:
        store.close()
    order = {g.name: i for i, g in enumerate(manifest.graphs)}
    graphs.sort(key=lambda g: order[g.name])
    if paired:
        graphs += write_stack(tmp, manifest, stackable)
    return graphs, reports


def _opset(path: Path) -> int:
    model = load_graph(path, False)
    return next((op.version for op in model.opset_import if op.domain in ("", "ai.onnx")), 0)
