"""`edgellm info EXPORT_DIR`: what an export holds and what `edgellm run` will execute (no torch needed)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np

from edgellm.runtime.manifest import FORMAT, MANIFEST, Manifest, read_manifest
from edgellm.runtime.session import SessionConfig
from edgellm.runtime.variant import runs_stack, stack_role


def is_export(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _precision(m: Manifest) -> str:
    q = m.quantization
    if q is None:
        return "fp32"
    o = q.get("options", {})  # the quantization record is free-form JSON: nothing here may raise
    bits = o.get("bits", "?")
    weights = q.get("weights") if isinstance(q.get("weights"), dict) else {}
    blocks = {w.get("block_size") for w in weights.values() if isinstance(w, dict) and w.get("op") != "Gather"
              and w.get("bits") == bits}  # the linears' blocks as written (the options may say null: the default)
    block = blocks.pop() if len(blocks) == 1 else o.get("group_size")
    linears = f"int{bits}" + (" per channel" if block == 0 else f" g{block if block is not None else '?'}")
    fmt = o.get("format", "?")
    kind = "with block minima" if o.get("block_min") == "on" else "sym" if o.get("symmetric", True) else "asym"
    method = o.get("method", "?")
    if o.get("block_min") == "on" and method in ("mse", "awq"):   # step and offset searched per block (methods.py)
        kind, method = "with block minima,", "k-quant search" + (" after AWQ's scale migration" if method == "awq" else "")
    if method == "grid":      # --block-min auto kept every linear on its own grid (quant/grids.py)
        kept = [k for k in o.get("kept_grids") or [] if isinstance(k, list) and len(k) == 4]
        n4 = sum(1 for k in kept if k[1] == 4)
        kind, method = "", (f"on their own grids ({n4} 4-bit, {sum(1 for k in kept if k[3])} of them with block "
                            f"minima; {len(kept) - n4} 8-bit)")
    return (f"{linears} {kind + ' ' if kind else ''}{method}, format {fmt}"
            + (f" (accuracy level {q.get('accuracy_level', '?')}{_scales(o)})" if fmt == "fast" else "")
            + f", lm_head {o.get('lm_head') or f'int{bits}'}{_rows(o)}, embeddings {o.get('embeddings', '?')}")


def _scales(options: dict) -> str:
    """How the block scales are stored (quant/plan.SCALES_DTYPES; not recorded before --scales-dtype)."""
    kind = options.get("scales_dtype")
    if kind == "auto":
        return ", scales float32 for 4-bit weights, float16 for 8-bit"
    return f", scales {kind}" if kind in ("float16", "float32") else ""


def _rows(options: dict) -> str:
    """A row-split lm_head (quant/headsplit.py): which share of its rows is int8."""
    rows = options.get("head_int8_rows", 1.0)
    return f" ({rows:.0%} of its rows, the rest int4)" if isinstance(rows, int | float) and rows < 1 else ""


def _per_token(m: Manifest) -> str:
    """The graphs the runtime runs per decoded token (runtime.engine, as a greedy `edgellm run` opens it)."""
    if m.granularity == "model":
        return "model.decode (1 run)"
    greedy = SessionConfig(exact=True)
    if runs_stack(m, greedy):
        stack = stack_role(m, greedy)
        lone = "; sampled runs: stack_lone.decode, no spare attention row" if m.has_lone_stack else ""
        if stack == "stack_lone":  # an int8 cache: the lone-row stack's rows are exact (runtime/variant.LONE_EXACT)
            lone = f"; the lone-row stack, exact with an {m.kv_dtype} cache: no spare attention row"
        return f"{stack}.decode + head.decode (2 runs; the layer graphs serve `edgellm diff`{lone})"
    return f"embed.decode + layer_0..{m.n_layers - 1}.decode + head.decode ({m.n_layers + 2} runs)"


def describe_export(path: Path) -> None:
    """Print an export's manifest in a form a person reads (every file's size and sha256 checked first)."""
    m = read_manifest(path)
    version = json.loads((path / MANIFEST).read_text())["format_version"]  # read_manifest checked it
    print(f"export: {path}")
    print(f"format: {FORMAT} {version} (written by edgellm {m.edgellm_version})")
    print(f"preset: {m.preset}  (dim {m.dim}, {m.n_layers} layers, {m.config.get('n_heads')}/{m.n_kv_heads} heads, "
          f"head_dim {m.model_head_dim}, vocab {m.vocab_size})")
    print(f"layout: granularity {m.granularity}, kv_layout {m.kv_layout}, kv_dtype {m.kv_dtype}, max_seq {m.max_seq}, "
          f"prefill_chunk {m.prefill_chunk}, opset {m.opset}")
    attention = m.export_options.get("attention_impl")  # recorded by export since issue 21
    if isinstance(attention, str):
        print(f"attention: {attention}")
    print(f"precision: {_precision(m)}")
    print(f"graphs: {len(m.graphs)} ({len({g.file for g in m.graphs})} files); per decoded token: {_per_token(m)}")
    rows = [m.dims.layer_rows(i) for i in range(m.n_layers)]
    width = np.dtype(m.kv_dtype).itemsize  # bytes per cached value
    kv = 2 * sum(rows) * m.n_kv_heads * m.head_dim * width
    rings = sum(r < m.max_seq for r in rows)
    print(f"size: {sum(f.bytes for f in m.files.values()) / 1e6:.2f} MB in {len(m.files)} files; "
          f"KV cache {kv / 1e6:.2f} MB ({m.kv_dtype}, allocated once"
          + (f"; heads zero-padded to {m.head_dim}" if m.head_dim != m.model_head_dim else "")
          + (f"; {rings} sliding-window layers keep rings of {min(rows)} rows, "
             f"{kv / (2 * m.n_layers * m.max_seq * m.n_kv_heads * m.head_dim * width):.0%} of full-length caches"
             if rings else "") + ")")
    tok = m.tokenizer
    chat = f"; chat template {tok['chat_template']} (run --chat)" if tok and tok["chat_template"] else ""
    eos = ", ".join(map(str, m.eos_ids)) or "none"
    print(f"tokenizer: {tok['file'] + ' (' + tok['kind'] + ')' if tok else 'none (token ids only)'}; "
          f"bos {m.bos_id}{' (put in front of text prompts)' if m.add_bos else ''}, eos {eos}{chat}")
    print("sampler defaults: " + ", ".join(f"{k} {v}" for k, v in m.sampler.items()))
    graphs = {k: v for k, v in m.verification.items() if "." in k}
    checks = [f"{k} {v:.3g}" for k, v in m.verification.items() if k not in graphs]
    if graphs:
        checks.insert(0, f"max relative |onnx - torch| {max(graphs.values()):.3g} over {len(graphs)} graphs")
    print("verification: " + ("; ".join(checks) if checks else "none recorded"))
    print(next_step(path, m))


def _quality(m: Manifest) -> tuple[str, bool | None]:
    """(the expected quality from the manifest's recorded check, whether it meets the default diff bar;
    None when nothing was recorded)."""
    from edgellm.diff.verdict import BAR_KL, BAR_TOP1, bar_text, parse_gate  # light: no torch

    bar = bar_text(parse_gate(f"kl>{BAR_KL:g},top1<{BAR_TOP1:g}"))
    if m.quantization is None:
        graphs = [v for k, v in m.verification.items() if "." in k]
        if not graphs:
            return "no recorded check", None
        return f"matches PyTorch to {max(graphs):.2g} (max relative, edgellm export's check)", True
    check = m.quantization.get("check") if isinstance(m.quantization.get("check"), dict) else None
    if check is None or not {"top1_agreement", "mean_kl"} <= set(check):
        return "quality not checked (quantized with --no-check)", None
    ok = check["mean_kl"] <= BAR_KL and check["top1_agreement"] >= BAR_TOP1
    return (f"top-1 {100 * check['top1_agreement']:.1f} %, mean KL {check['mean_kl']:.2g} vs fp32 on "
            f"{check.get('positions', '?')} positions ({'within' if ok else 'MISSES'} {bar})"), ok


def run_command(path: Path, m: Manifest) -> str:
    """A pasteable `edgellm run` for this export: text prompt, chat, or token ids when it has no tokenizer."""
    cmd = ["edgellm", "run", str(path)]
    tok = m.tokenizer
    if tok is None:
        cmd += ["--prompt-ids", str(m.bos_id if m.bos_id is not None else 0)]
    elif tok["chat_template"]:
        cmd += ["--chat", "--prompt", "Hello! Who are you?"]
    else:
        cmd += ["--prompt", "Once upon a time"]
    return shlex.join(cmd)


def next_step(path: Path, m: Manifest, size_note: str = "", source: Path | None = None) -> str:
    """The one line `edgellm info` and `edgellm quantize` end with: size, expected quality, next command.
    `source`: the fp32 export a quantized one came from (known to `edgellm quantize`)."""
    size = sum(f.bytes for f in m.files.values()) / 1e6
    if not size_note and m.quantization is not None:
        wb = m.quantization.get("weight_bytes") or {}
        if wb.get("before"):
            size_note = f", weights {wb['after'] / wb['before']:.2f}x of fp32"
    quality, ok = _quality(m)
    if ok is False or (ok is None and m.quantization is not None):
        exports = [str(source), str(path)] if source is not None else [str(path)]
        cmd = shlex.join(["edgellm", "diff", "CHECKPOINT", *exports, "-o", f"{str(path).rstrip('/')}-report"])
        nxt = f"{cmd} (CHECKPOINT: the model you exported) to see which layers to --keep / --int8-layers"
        if ok is False and (m.quantization.get("options") or {}).get("bits") == 4:
            nxt += ("; or quantize again with --kl-budget X (the smallest of a ladder of settings within mean KL X, "
                    "up to Q4_K_M-level block minima)")
    else:
        nxt = run_command(path, m)
    return f"{path}: {size:.2f} MB{size_note}; {quality}; next: {nxt}"
