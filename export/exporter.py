"""`export_model`: Decoder -> export directory (graphs, data, tokenizer, manifest.json), verified.

Work happens in `<out>.partial/`, journaled unit by unit so an interrupted export resumes; `<out>` appears
(or replaces a previous export) in one rename at the very end, so it never holds a manifest that lists a
missing file.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import onnx
import torch
from tqdm import tqdm

from edgellm import __version__
from edgellm.layout.stacking import LONE_FILE, STACK_FILE, check_lone, check_stack, pair_head, write_stack
from edgellm.loaders.lazy import Resident, Weights
from edgellm.model import Decoder
from edgellm.runtime.errors import need
from edgellm.runtime.fileio import FileSpec, atomic_dir, describe_files
from edgellm.runtime.graphio import dims_from_config, ring_layers, spare_rows
from edgellm.runtime.manifest import COVER_SINCE, FORMAT_VERSION, MANIFEST, GraphSpec, Manifest
from edgellm.runtime.sampling import SamplingParams
from edgellm.runtime.tokenizer import TOKENIZER_FILES, copy_tokenizer, tokenizer_kind

from .bos_rule import add_bos_rule, rule_notes
from .e2e import check_end_to_end
from .fused_heads import attention_record, cache_head_dim
from .graphs import Unit, plan_units
from .journal import Journal, UnitRecord, export_identity
from .memory import release_memory
from .options import ExportOptions
from .tokenizer_files import (
    CHAT_TEMPLATE,
    check_chat_template,
    check_tokenizer,
    eos_ids,
    find_chat_template,
    read_chat_template,
)
from .unit import export_unit, variant_seqs, write_rope_tables

SAMPLER_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.0)


def _stderr(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def export_model(model: Decoder, out: Path, options: ExportOptions, tokenizer: Path | None = None,
                 log: Callable[[str], None] = _stderr, progress: bool = True,
                 chat_template: Path | None = None, add_bos: bool | None = None,
                 weights: Weights | None = None) -> Manifest:
    """Export, verify (every graph and end to end) and write `out`; returns the manifest written. The chat
    template is `chat_template` (a .jinja or tokenizer_config.json) or else the one beside `tokenizer`.
    `add_bos` (whether text prompts get BOS) defaults to what `tokenizer` defines (bos_rule.add_bos_rule);
    `edgellm export` passes the checkpoint's rule (bos_rule.checkpoint_add_bos).

    `weights`: where `model`'s parameters come from, when it is not resident (`LazyWeights` of a lazily
    loaded checkpoint, `model` = its meta-device Decoder): each unit, and each part of the end-to-end
    forward, holds only its own parameters, so peak memory is bounded by the largest unit, not the model.
    Leaves `model` in eval mode with its RoPE built for `options.max_seq` (what the graphs compute).
    """
    start = time.perf_counter()
    out = Path(out)
    cfg = model.cfg
    options.validate(cfg)
    attention = attention_record(cfg, options.attention, options.granularity, options.max_seq, options.sliding_cache)
    # fused layers pad every head to a size GroupQueryAttention takes; the cache rows are that wide (format 7)
    padded = cache_head_dim(cfg) if options.kv_layout == "inplace" else cfg.hd
    kv_head_dim = padded if padded != cfg.hd else None
    need(all(p.dtype == torch.float32 for p in model.parameters()), "model: expected float32 weights")
    _check_target(out)
    loaded_tok = check_tokenizer(tokenizer, cfg)
    found = read_chat_template(chat_template) if chat_template is not None else find_chat_template(tokenizer)
    template = check_chat_template(found, loaded_tok, cfg) if found is not None else None
    if tokenizer is not None:
        if add_bos is None:
            add_bos = cfg.bos_id is not None and add_bos_rule(tokenizer, cfg.bos_id)
        need(not add_bos or cfg.bos_id is not None, "add_bos: the model has no BOS id to put in front")
        for note in rule_notes(tokenizer, add_bos):
            log(note)
    parts = weights if weights is not None else Resident(model)
    need(parts.model is model, "internal: weights belong to another model")
    model.eval()
    model.set_context_len(options.max_seq)
    # format 16 where its rules keep fewer rings than 14's (a window covering max_seq, graphio.ring_layers) or
    # --sliding-cache full is recorded; the fused layers only (the traced layouts' rings of max_seq rows are linear)
    fused = options.kv_layout == "inplace"
    cover = fused and ring_layers(cfg.to_dict(), options.max_seq) != ring_layers(cfg.to_dict(), options.max_seq, False)
    version = COVER_SINCE if cover or options.sliding_cache != "ring" else FORMAT_VERSION
    spare = spare_rows(options.kv_layout, version)  # fused attention's extra cache row (graphio.py)
    dims = dims_from_config(cfg.to_dict(), options.max_seq, options.kv_layout, kv_head_dim, options.prefill_chunk,
                            spare, options.kv_dtype, cover, options.sliding_cache)

    partial = out.with_name(out.name + ".partial")
    journal = Journal.open(partial, export_identity(model.cfg, parts.tensors(), options), log)
    n_params = cfg.n_params()
    release_memory(n_params)
    if tokenizer is not None:  # xz-compressing a large vocabulary (Gemma 3's 12 MB: 10 s) on the core tracing leaves idle
        kind = tokenizer_kind(tokenizer)
        tok_file = TOKENIZER_FILES[kind]
        side = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tok_job = side.submit(copy_tokenizer, tokenizer, partial / tok_file, kind)
        side.shutdown(wait=False)  # the thread ends with the job; an error comes out of tok_job.result()
    units = plan_units(model, options.granularity, options.kv_layout, tuple(dims.ring(i) for i in range(cfg.n_layers)))
    seqs = variant_seqs(options)
    rope = None
    if options.kv_layout == "inplace":  # fused layers: their RoPE tables written once (rewritten on a resume:
        with parts.holding(("rotary.", "rotary_local.")):  # the same bytes keep the recorded layers valid)
            # max_seq + spare positions: GroupQueryAttention's extra zero row sits at position max_seq at most
            rope = write_rope_tables(model, partial, options.max_seq + spare)
    records: dict[str, UnitRecord] = {}
    with torch.no_grad(), tqdm(total=len(units) * len(seqs), desc="export", unit="graph", file=sys.stderr,
                               disable=not progress, leave=False) as bar:
        for unit in units:
            bar.set_postfix_str(unit.stem)
            rec, why = journal.reusable(unit.stem)
            if rec is not None:
                log(f"reusing {unit.stem} ({why})")
                bar.update(len(seqs))
            else:
                if unit.stem in journal.units:
                    log(f"re-exporting {unit.stem}: {why}")
                journal.forget(unit.stem)
                known = records["head"].refs() if unit.role == "embed" and "head" in records else {}
                with parts.holding(unit.weight_prefixes):
                    rec = export_unit(model, unit, partial, dims, options, known, lambda _: bar.update(1), rope)
                release_memory(n_params)  # this unit's copies (onnx_ir graphs are cycles) before the next unit's
                journal.record(unit.stem, rec)
            records[unit.stem] = rec

    files = {rel: FileSpec(sha, (partial / rel).stat().st_size)
             for rec in records.values() for rel, sha in rec.files.items()}
    tok_entry = None
    if tokenizer is not None:
        tok_job.result()  # a tokenizer.json minified (and xz-compressed), written beside the units
        if template is not None:
            (partial / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
        files |= describe_files(partial, [tok_file] + ([CHAT_TEMPLATE] if template is not None else []))
        tok_entry = {"file": tok_file, "kind": kind, "chat_template": CHAT_TEMPLATE if template is not None else None,
                     "add_bos": bool(add_bos)}
    verification = {name: d for rec in records.values() for name, d in rec.verification.items()}
    manifest = Manifest(
        edgellm_version=__version__, preset=cfg.preset, config=cfg.to_dict(), granularity=options.granularity,
        kv_layout=options.kv_layout,
        max_seq=options.max_seq, prefill_chunk=options.prefill_chunk, opset=options.opset,
        graphs=tuple(_graph_specs(units, records, dims, seqs)), files=files, tokenizer=tok_entry,
        bos_id=cfg.bos_id, eos_id=cfg.eos_id, eos_ids=eos_ids(cfg), sampler=asdict(SAMPLER_DEFAULTS), quantization=None,
        export_options={**options.to_dict(), "attention_impl": attention,
                        "exporter": f"torch.onnx dynamo (torch {torch.__version__})"},
        verification=verification, kv_head_dim=kv_head_dim,
        kv_cache_rows=dims.rows if any(r != dims.max_seq for r in dims.rows) else None, kv_dtype=options.kv_dtype,
        sliding_cache=options.sliding_cache, format_version=version)
    release_memory(n_params)
    e2e = check_end_to_end(parts, partial, manifest, options.seed)
    need(e2e <= options.tolerance, f"end-to-end: onnxruntime logits differ from the PyTorch forward by {e2e:.3g} "
                                   f"> --atol {options.tolerance:g} (chunked prefill + decode, the runtime's Engine)")
    manifest = replace(manifest, verification={**verification, "end_to_end": e2e})
    if options.kv_layout == "inplace" and options.prefill_chunk > 1:
        release_memory(n_params)  # the check runs the whole model in onnxruntime (~1x the weights): nothing else left
        manifest = _add_stack(partial, manifest, options.seed)

    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty directory the user made for us: atomic_dir replaces only earlier exports
    with atomic_dir(out, marker=MANIFEST) as tmp:
        for rel in manifest.files:
            _link_or_move(partial / rel, tmp / rel)
        manifest.write(tmp)
    shutil.rmtree(partial, ignore_errors=True)
    for line in summary(units, records, manifest, time.perf_counter() - start, out):
        log(line)
    return manifest


def _add_stack(partial: Path, manifest: Manifest, seed: int) -> Manifest:
    """`stack.onnx` (stacking.py): the embedding and every layer in one graph reading their data files, the
    runtime's path (2 onnxruntime runs per token, every weight pre-packed once), checked through the runtime
    against the layer graphs, which stay for `edgellm diff` and `SessionConfig(stack=False)`."""
    variants: dict[int, list[onnx.ModelProto]] = {}  # S -> embed, layer_0, ... (manifest order)
    for g in manifest.graphs:
        if g.role in ("embed", "layer"):
            variants.setdefault(g.seq, []).append(onnx.load(str(partial / g.file), load_external_data=False))
    specs = write_stack(partial, manifest, variants)
    manifest = replace(manifest, graphs=manifest.graphs + tuple(specs),
                       files=manifest.files | describe_files(partial, sorted({g.file for g in specs})))
    manifest = pair_head(partial, manifest)  # one head session for S = 1 and a verification's k + 1 rows
    tokens = np.random.default_rng(seed).integers(0, manifest.vocab_size, manifest.prefill_chunk + 4).tolist()
    checks = {"stack_vs_layers": check_stack(partial, manifest, tokens)}
    if manifest.has_lone_stack:
        checks["lone_vs_stack"] = check_lone(partial, manifest, tokens)
    return replace(manifest, verification={**manifest.verification, **checks})


def _graph_specs(units: list[Unit], records: dict[str, UnitRecord], dims, seqs: list[int]) -> list[GraphSpec]:
    specs = []
    for unit in units:
        for seq in seqs:
            name, file, _, inputs, outputs = unit.graph(seq, dims)
            specs.append(GraphSpec(name, unit.role, unit.layer, seq, file, records[unit.stem].data, inputs, outputs))
    return specs


def summary(units: list[Unit], records: dict[str, UnitRecord], manifest: Manifest, seconds: float,
            out: Path) -> list[str]:
    """The end-of-export table: unit, MB of its own files, max abs diff of each variant."""
    files, e2e = manifest.files, manifest.verification["end_to_end"]
    lines = [f"{'graph':<12} {'MB':>9}  max |onnx - torch| per variant"]
    for unit in units:
        rec = records[unit.stem]
        own = sum(f.bytes for rel, f in files.items() if rel.startswith(f"{unit.stem}."))  # head.onnx: paired
        diffs = "  ".join(f"{name.split('.')[-1]} {d:.2e}" for name, d in rec.verification.items())
        lines.append(f"{unit.stem:<12} {own / 1e6:>9.2f}  {diffs}")
    total = sum(f.bytes for f in files.values())
    if STACK_FILE in files:
        diff = manifest.verification["stack_vs_layers"]
        lines.append(f"{'stack':<12} {files[STACK_FILE].bytes / 1e6:>9.2f}  {diff:.2e} (vs the layer graphs)")
    if LONE_FILE in files:
        diff = manifest.verification["lone_vs_stack"]
        lines.append(f"{'stack_lone':<12} {files[LONE_FILE].bytes / 1e6:>9.2f}  {diff:.2e} (decode vs the stack; "
                     "no spare attention row: sampled runs)")
    lines.append(f"{'end-to-end':<12} {'':>9}  {e2e:.2e} (chunked prefill + decode vs full forward)")
    if "attention_impl" in manifest.export_options:
        lines.append(f"{'attention':<12} {'':>9}  {manifest.export_options['attention_impl']}")
    lines.append(f"wrote {out} ({len(files)} files, {total / 1e6:.1f} MB) in {seconds:.1f} s")
    return lines


def _check_target(out: Path) -> None:
    """Fail before any work if `out` could not be replaced at the end."""
    existing = next((p for p in (out, *out.parents) if p.exists()), out)  # out.partial is made under it
    need(existing == out or existing.is_dir(), f"-o {out}: {existing} is not a directory")
    need(not out.exists() or out.is_dir(), f"-o {out}: exists and is not a directory")
    need(not out.exists() or (out / MANIFEST).is_file() or not any(out.iterdir()),
         f"-o {out}: exists and holds no {MANIFEST}; refusing to replace it (choose a new or empty directory)")


def _link_or_move(src: Path, dst: Path) -> None:
    """A hard link keeps the partial directory resumable until the final rename; move where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.move(src, dst)
