"""Quantization quality: which scheme, how much accuracy (docs/quantization.md).

    python bench/quant_quality.py [--work DIR] [--models demo,stories260k,medium] [--tokens 4096]
                                  [--demo-checkpoint DIR] [--no-diff]

Per model: the fp32 export, then every scheme of the grid - int8 per channel, int4 with groups of
32/64/128 - x method (rtn, mse, awq) x symmetric/asymmetric, each written by `quantize_export` (what
`edgellm quantize` runs) with the defaults for the rest (lm_head at the linears' bits, int8 embeddings,
accuracy level 4), plus int4 g32 with `--lm-head int8` ("-head8": the quality the head's precision buys).
Every variant runs the same held-out tokens through the runtime's prefill graphs (teacher forcing), and
is compared with the fp32 export: mean KL(fp32 || quant), top-1 agreement, perplexity and its change,
and the linear weights' size (scales and zero points included) against fp32. Then `edgellm diff` (against
the PyTorch checkpoint) on fp32, int8 and int4 g32 rtn/awq as a cross-check.

Models and evaluation text:
  demo        the demo's llama2-preset model (`train_demo(size="small")`, ~3 min, or --demo-checkpoint);
              held-out stories from the demo's generator (seed 4242, the model trained on seed 0).
  medium      a larger model of another preset: qwen3 (qk-norm, GQA, tied embeddings), ~3.4 M parameters
              (`train_demo(size="medium", budget_s=480)`, ~8 min); evaluated exactly like demo.
  stories260k llama2.c's stories260K (real weights, /work/shared/models). Its tokenizer is not available,
              so the text is sampled from the fp32 export (temperature 1, seed 50000; calibration for awq
              uses seed 0, so the two never share a sequence).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgellm.export import ExportOptions, export_model
from edgellm.export.bos_rule import checkpoint_add_bos
from edgellm.loaders import load_checkpoint
from edgellm.quant.calibrate import sample_sequences
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from edgellm.quant.report import ratio_by_kind
from edgellm.quant.runner import export_logits
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.metrics import kl_divergence, log_softmax
from edgellm.runtime.tokenizer import load_tokenizer

STORIES260K = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.bin"
MAX_SEQ, SEQUENCE = 256, 256
TRAINED = {"demo": ("small", 170.0), "medium": ("medium", 480.0)}  # model -> train_demo size, budget (s)
MODELS = ("stories260k", *TRAINED)
GRID = ([dict(bits=8, group_size=0, symmetric=s, method=m) for s in (True, False) for m in ("rtn", "mse", "awq")]
        + [dict(bits=4, group_size=g, symmetric=s, method=m) for g in (32, 64, 128) for s in (True, False)
           for m in ("rtn", "mse", "awq")]
        + [dict(bits=4, group_size=32, symmetric=True, method=m, lm_head="int8") for m in ("rtn", "mse", "awq")])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint(name: str, work: Path, demo_checkpoint: Path | None) -> Path:
    if name == "stories260k":
        return STORIES260K
    if name == "demo" and demo_checkpoint is not None:
        return demo_checkpoint
    size, budget_s = TRAINED[name]
    out = work / f"{name}-checkpoint"
    if not (out / "model.safetensors").is_file():
        from edgellm.train.demo import train_demo

        log(f"training the {name} model (size {size!r}, ~{budget_s / 60:.0f} min)")
        result = train_demo(out, budget_s=budget_s, size=size, progress=False)
        log(f"{name}: {result.n_params:,} params, val loss {result.val_loss:.3f} "
            f"(unigram entropy {result.unigram_entropy:.3f}), {result.train.steps} steps")
    return out


def export(ckpt: Path, out: Path) -> Path:
    if not (out / "manifest.json").is_file():
        loaded = load_checkpoint(ckpt)
        options = ExportOptions(max_seq=MAX_SEQ, prefill_chunk=32)
        add_bos = checkpoint_add_bos(loaded.source, loaded.tokenizer_path, loaded.config.bos_id)
        export_model(loaded.model, out, options, loaded.tokenizer_path, progress=False, log=lambda _: None,
                     add_bos=add_bos)
    return out


def eval_sequences(name: str, fp32: Path, n_tokens: int, text_file: Path) -> list[list[int]]:
    """Held-out token sequences (BOS first when the export's rule adds one, <= SEQUENCE tokens each) totalling
    ~n_tokens."""
    if name == "stories260k":
        return sample_sequences(fp32, n_tokens, seed=50_000, length=SEQUENCE)
    from edgellm.train.corpus import generate_corpus

    m = read_manifest(fp32)
    tok = load_tokenizer(fp32 / m.tokenizer["file"], m.vocab_size, bos_id=m.bos_id, eos_id=m.eos_id)
    stories = generate_corpus(400, seed=4242)
    text_file.write_text("\n\n".join(stories[:40]) + "\n", encoding="utf-8")    # for `edgellm diff --text`
    sequences, total = [], 0
    for s in stories:
        seq = ([m.bos_id] if m.add_bos else []) + tok.encode(s)
        seq = seq[:SEQUENCE]
        sequences.append(seq)
        total += len(seq)
        if total >= n_tokens:
            break
    return sequences


def evaluate(directory: Path, sequences: list[list[int]], refs: list[np.ndarray]) -> dict:
    kl, agree, nll_q, nll_r = [], [], 0.0, 0.0
    for seq, ref, got in zip(sequences, refs, export_logits(directory, read_manifest(directory), sequences),
                             strict=True):
        got = got[:-1]                         # row t predicts seq[t + 1]
        r = ref[:-1]
        kl.append(kl_divergence(r, got))
        agree.append(r.argmax(-1) == got.argmax(-1))
        target = np.asarray(seq[1:])
        nll_q -= float(log_softmax(got)[np.arange(len(target)), target].sum())
        nll_r -= float(log_softmax(r)[np.arange(len(target)), target].sum())
    n = sum(len(s) - 1 for s in sequences)
    ppl, ppl_ref = float(np.exp(nll_q / n)), float(np.exp(nll_r / n))
    return {"mean_kl": float(np.concatenate(kl).mean()), "top1": float(np.concatenate(agree).mean()),
            "ppl": ppl, "ppl_fp32": ppl_ref, "dppl_pct": 100 * (ppl / ppl_ref - 1), "positions": n}


def label(c: dict) -> str:
    group = f"g{c['group_size']}" if c["group_size"] else "ch"
    head = "-head8" if c.get("lm_head") == "int8" and c["bits"] == 4 else ""
    return f"int{c['bits']}-{group}-{'sym' if c['symmetric'] else 'asym'}-{c['method']}{head}"


def run_model(name: str, args: argparse.Namespace) -> dict:
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(name, args.work, args.demo_checkpoint)
    fp32 = export(ckpt, work / "fp32")
    text_file = work / "heldout.txt"
    sequences = eval_sequences(name, fp32, args.tokens, text_file)
    refs = export_logits(fp32, read_manifest(fp32), sequences)
    rows = []
    for c in GRID:
        out = work / label(c)
        start = time.perf_counter()
        result = quantize_export(fp32, out, QuantizeOptions(**c), check=False, progress=False, log=lambda _: None)
        seconds = time.perf_counter() - start
        row = {"scheme": label(c), **c, "quantize_s": round(seconds, 2),
               "linear_size_ratio": ratio_by_kind(result.weights)["linears"],
               "export_mb": result.files_after / 1e6, "fp32_mb": result.files_before / 1e6,
               **evaluate(out, sequences, refs)}
        rows.append(row)
        log(f"{name} {row['scheme']:<22} KL {row['mean_kl']:.3e} top1 {row['top1']:.2%} dPPL {row['dppl_pct']:+.2f}%")
    diff = None if args.no_diff else run_diff(ckpt, fp32, work, None if name == "stories260k" else text_file)
    return {"model": name, "checkpoint": str(ckpt), "eval_positions": rows[0]["positions"],
            "ppl_fp32": rows[0]["ppl_fp32"], "rows": rows, "diff": diff}


def run_diff(ckpt: Path, fp32: Path, work: Path, text: Path | None) -> str:
    """`edgellm diff` on the headline variants; its Markdown summary."""
    variants = [fp32] + [work / v for v in ("int8-ch-sym-rtn", "int4-g32-sym-rtn", "int4-g32-sym-awq")]
    cmd = [sys.executable, "-m", "edgellm", "diff", str(ckpt), *map(str, variants), "-o", str(work / "diff"),
           "--quiet", *(["--text", str(text)] if text else ["--tokens", str(MAX_SEQ)])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else f"edgellm diff failed: {done.stderr.strip()[-500:]}"


def markdown(result: dict) -> list[str]:
    lines = [f"### {result['model']} (fp32 PPL {result['ppl_fp32']:.3f} on {result['eval_positions']} held-out "
             f"positions)", "",
             "| scheme | linears size vs fp32 | top-1 agreement | mean KL | PPL | ΔPPL |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['scheme']} | {r['linear_size_ratio']:.3f}x | {r['top1']:.2%} | {r['mean_kl']:.2e} | "
                     f"{r['ppl']:.3f} | {r['dppl_pct']:+.2f}% |")
    if result["diff"]:
        lines += ["", "`edgellm diff` cross-check (vs the PyTorch checkpoint):", "", result["diff"].strip()]
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/edgellm-bench/quant"))
    p.add_argument("--models", default="demo,stories260k", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens per model")
    p.add_argument("--demo-checkpoint", type=Path, default=None)
    p.add_argument("--no-diff", action="store_true")
    args = p.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
    results = [run_model(name, args) for name in args.models.split(",")]
    (args.work / "quant_quality.json").write_text(json.dumps(results, indent=1))
    text = "\n".join(line for r in results for line in markdown(r))
    (args.work / "quant_quality.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
