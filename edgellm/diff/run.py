"""`run_diff`: the PyTorch model against each export directory, as one report dict (see report_json)."""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from edgellm import __version__
from edgellm.export.bos_rule import checkpoint_add_bos
from edgellm.loaders.loaded import Loaded
from edgellm.runtime.errors import need
from edgellm.runtime.manifest import Manifest, read_manifest

from .collect_ort import export_greedy, export_trace, open_engine
from .collect_torch import torch_greedy, torch_trace
from .compare import greedy_agreement, logits_and_ppl, per_layer
from .gate import evaluate_gate, parse_gate
from .text import add_greedy_text, display_tokenizer, export_tokenizer, file_tokens, generated_tokens
from .trace import Trace

# config keys that must agree between the checkpoint and an export made from it
_SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim")
# Below this many parameters every op is so small that thread hand-offs cost more than they save (a 3M
# model's 32-token greedy run: 0.08 s on 1 thread, 1.4-5 s on 2 busy cores).
SMALL_MODEL = 30_000_000


@dataclass(frozen=True)
class DiffOptions:
    text: Path | None = None          # evaluation text file; None -> generated text
    generated: int | None = None      # tokens to generate (None: tokens - 1)
    tokens: int = 256                 # evaluation tokens including BOS (capped at the smallest max_seq)
    prompts: int = 4                  # greedy continuation prompts, sliced from the evaluation tokens
    prompt_len: int = 16
    continuation: int = 32            # greedy tokens per prompt
    seed: int = 0                     # for --generated
    jump_factor: float = 3.0          # drift rule, see metrics.first_jump
    jump_floor: float = 1e-3
    fail_if: str | None = None
    verify_sha: bool = True           # hash every export file against its manifest
    threads: int | None = None        # torch/onnxruntime threads; None: 1 below SMALL_MODEL params, else all


@dataclass
class _Context:
    """What every pass shares: the evaluation tokens, prompt slices, stop token, threads, progress bar."""

    tokens: list[int]
    starts: list[int]
    eos: int | None
    threads: int | None  # None: the libraries' defaults
    options: DiffOptions
    bar: Any


def check_compatible(loaded: Loaded, directory: Path, manifest: Manifest) -> None:
    ours = loaded.config.to_dict()
    for key in _SHAPE_KEYS:
        need(manifest.config.get(key) == ours[key],
             f"{directory}: config.{key}={manifest.config.get(key)} but the checkpoint has {ours[key]} "
             "(was this export made from another model?)")


def prompt_starts(n_tokens: int, n_prompts: int, prompt_len: int) -> list[int]:
    """Evenly spaced slice starts over the evaluation tokens (the first at 0, so it begins as a prompt does)."""
    if n_prompts <= 1:
        return [0][:n_prompts]
    last = max(n_tokens - prompt_len, 0)
    return sorted({round(p * last / (n_prompts - 1)) for p in range(n_prompts)})


def variant_names(dirs: list[Path]) -> list[str]:
    """The export directories' names, made unique ("int4", "int4#2")."""
    names: list[str] = []
    for d in dirs:
        name = Path(d).resolve().name or str(d)
        names.append(name if name not in names else f"{name}#{len(names) + 1}")
    return names


def run_diff(loaded: Loaded, checkpoint: str, export_dirs: list[Path], options: DiffOptions,
             progress: bool = True) -> dict[str, Any]:
    """Compare `loaded.model` with every export; returns the report (gate evaluated when options.fail_if)."""
    t0 = time.perf_counter()
    conditions = parse_gate(options.fail_if) if options.fail_if else None  # bad syntax fails before any work
    need(options.tokens >= 2, f"--tokens: expected at least 2, got {options.tokens}")
    need(options.prompts >= 0, f"--prompts: expected >= 0, got {options.prompts}")
    need(options.prompt_len >= 1, f"--prompt-len: expected >= 1, got {options.prompt_len}")
    need(options.continuation >= 1, f"--continuation: expected >= 1, got {options.continuation}")
    need(options.threads is None or options.threads >= 1, f"--threads: expected >= 1, got {options.threads}")
    exports = [(Path(d), read_manifest(Path(d), verify=options.verify_sha)) for d in export_dirs]
    for directory, manifest in exports:
        check_compatible(loaded, directory, manifest)
    loaded.model.eval()
    threads = options.threads if options.threads is not None else (1 if loaded.config.n_params() < SMALL_MODEL else None)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    bos, eos = special_ids(loaded, exports[0][1])
    try:
        tokens, text_info = _eval_tokens(loaded, exports, options, bos, eos)
        starts = prompt_starts(len(tokens), options.prompts, options.prompt_len)
        keys = sorted({(m.max_seq, m.prefill_chunk) for _, m in exports})
        with tqdm(total=(len(keys) + len(exports)) * (1 + len(starts)), desc="diff", unit="pass",
                  disable=not progress, leave=False) as bar:
            ctx = _Context(tokens, starts, eos, threads, options, bar)
            # the reference once per (context length, chunking) the exports use
            refs = {key: _reference(loaded, key, ctx) for key in keys}
            variants = [_variant(name, d, m, refs[(m.max_seq, m.prefill_chunk)], ctx)
                        for name, (d, m) in zip(variant_names([d for d, _ in exports]), exports, strict=True)]
    finally:
        torch.set_num_threads(saved_threads)
    tok = display_tokenizer(exports, loaded.tokenizer_path, loaded.config.vocab_size, bos, eos)
    if tok is not None:
        for v in variants:
            add_greedy_text(v, tokens, tok)

    gate = None
    if conditions is not None:
        failed = evaluate_gate(conditions, variants)
        gate = {"conditions": [str(c) for c in conditions], "failed": failed, "passed": not failed}
    settings = {**asdict(options), "text": str(options.text) if options.text else None, "prompts": len(starts),
                "threads": threads}
    return {
        "edgellm_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": {"path": checkpoint, "source": loaded.source},
        "text": text_info,
        "settings": settings,
        "reference": {"ppl": {str(v["max_seq"]): v["ppl"]["ref_ppl"] for v in variants}},
        "variants": variants,
        "gate": gate,
        "seconds": time.perf_counter() - t0,
    }


def precision(quantization: dict[str, Any] | None) -> str:
    """A short label from the manifest's quantization record: "fp32", "int4 g32 sym rtn", "int8 per-channel"."""
    if quantization is None:
        return "fp32"
    opts = quantization.get("options") if isinstance(quantization.get("options"), dict) else {}
    if "bits" not in opts:
        return "quantized"
    group = opts.get("group_size")
    parts = [f"int{opts['bits']}", f"g{group}" if group else "per-channel"]
    if "symmetric" in opts:
        parts.append("sym" if opts["symmetric"] else "asym")
    if opts.get("method"):
        parts.append(str(opts["method"]))
    return " ".join(parts)


def _quant_summary(quantization: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest's quantization record without its per-weight table (that stays in the export)."""
    return None if quantization is None else {k: v for k, v in quantization.items() if k != "weights"}


def special_ids(loaded: Loaded, manifest: Manifest) -> tuple[int | None, int | None]:
    """(BOS, EOS): the (first) export's, else the checkpoint config's."""
    cfg = loaded.config
    return (manifest.bos_id if manifest.bos_id is not None else cfg.bos_id,
            manifest.eos_id if manifest.eos_id is not None else cfg.eos_id)


def _eval_tokens(loaded: Loaded, exports: list[tuple[Path, Manifest]], options: DiffOptions, bos: int | None,
                 eos: int | None) -> tuple[list[int], dict[str, Any]]:
    cfg = loaded.config
    max_seq = min(m.max_seq for _, m in exports)
    n_tokens = min(options.tokens, max_seq)
    if options.text is not None:
        # tokenized as `edgellm run --prompt` does: the export's tokenizer and rule, else the checkpoint's
        found = export_tokenizer(exports)
        tokenizer, add_bos = found if found is not None else (
            loaded.tokenizer_path, checkpoint_add_bos(loaded.source, loaded.tokenizer_path, cfg.bos_id))
        return file_tokens(options.text, tokenizer, n_tokens, cfg.vocab_size, bos, eos, add_bos)
    n_new = options.generated if options.generated is not None else n_tokens - 1
    need(n_new + 1 <= max_seq, f"--generated {n_new}: {n_new + 1} tokens with BOS exceed max_seq={max_seq}")
    loaded.model.set_context_len(max_seq)
    return generated_tokens(loaded.model, n_new, options.seed, bos, eos, max_seq)


def _reference(loaded: Loaded, key: tuple[int, int], ctx: _Context) -> tuple[Trace, list[list[int]]]:
    """PyTorch's trace and greedy continuations for exports of this (max_seq, prefill_chunk)."""
    max_seq, chunk = key
    model, o = loaded.model, ctx.options
    model.set_context_len(max_seq)  # LongRoPE picks its factors by the context the export is built for
    ctx.bar.set_description(f"PyTorch (max_seq {max_seq}, chunk {chunk})")
    trace = torch_trace(model, ctx.tokens, chunk, max_seq)
    ctx.bar.update()
    runs = []
    for s in ctx.starts:
        runs.append(torch_greedy(model, ctx.tokens[s:s + o.prompt_len], o.continuation, chunk, max_seq, ctx.eos))
        ctx.bar.update()
    return trace, runs


def _variant(name: str, directory: Path, manifest: Manifest, ref: tuple[Trace, list[list[int]]],
             ctx: _Context) -> dict[str, Any]:
    """One export's section of the report."""
    t0 = time.perf_counter()
    o = ctx.options
    ref_trace, ref_runs = ref
    engine = open_engine(directory, manifest, ctx.threads)
    ctx.bar.set_description(f"{name}: teacher-forced pass")
    got = export_trace(engine, ctx.tokens)
    del engine  # its sessions and weight maps, before the Generator opens its own
    ctx.bar.update()
    ctx.bar.set_description(f"{name}: greedy continuations")
    prompts = [ctx.tokens[s:s + o.prompt_len] for s in ctx.starts]
    runs = export_greedy(directory, prompts, o.continuation, ctx.threads, ctx.bar.update)
    logits, ppl = logits_and_ppl(ref_trace, got, ctx.tokens)
    return {
        "name": name, "path": str(directory), "granularity": manifest.granularity, "max_seq": manifest.max_seq,
        "prefill_chunk": manifest.prefill_chunk, "precision": precision(manifest.quantization),
        "quantization": _quant_summary(manifest.quantization),
        "per_layer": per_layer(ref_trace, got, o.jump_factor, o.jump_floor),
        "logits": logits, "ppl": ppl,
        "greedy": greedy_agreement(ref_runs, runs, ctx.starts, o.prompt_len),
        "seconds": time.perf_counter() - t0,
    }
