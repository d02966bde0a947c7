"""Quantized decode speed: fp32 vs int8 vs int4 exports of one model, per MatMulNBits accuracy level.

    python bench/quant_speed.py FP32_EXPORT [--work DIR] [--levels 0,1,4] [--new-tokens 64] [--runs 3]

Quantizes the fp32 export (RTN: speed does not depend on the method) to int8 per channel and int4 g32 at
each accuracy level (fast format), plus the portable int4 (onnxruntime fuses it into MatMulNBits at its
default level 4), then runs `edgellm bench --json` on each (2 threads, greedy, EOS ignored, a 64-token
prompt, median of --runs after a warm-up; runs repeat while other processes load the CPU) and prints
decode tok/s, prefill tok/s, TTFT, peak RSS and the export size next to fp32's. Meant for a
stories110M-shaped export: `python bench/make_models.py --only s110m` + `edgellm export`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions


def variants(levels: list[int]) -> dict[str, QuantizeOptions]:
    out = {}
    for bits in (8, 4):
        for level in levels:
            out[f"int{bits}-L{level}"] = QuantizeOptions(bits=bits, accuracy_level=level)
    out["int4-portable"] = QuantizeOptions(bits=4, format="portable")
    return out


def bench(directory: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "edgellm", "bench", str(directory), "--json", "--contexts", "64",
           "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])["rows"][0]
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return {"decode_tok_s": row["decode_tok_s"]["median"], "prefill_tok_s": row["prefill_tok_s"]["median"],
            "ttft_ms": row["ttft_ms"]["median"], "peak_rss_mb": row["peak_rss_mb"], "mb": size / 1e6,
            "other_load_pct": row["foreign_load_pct"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32", type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/edgellm-bench/quant-speed"))
    p.add_argument("--levels", default="0,1,4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    results = {"fp32": bench(args.fp32, args)}
    print(f"fp32: {results['fp32']}", file=sys.stderr, flush=True)
    for name, options in variants([int(x) for x in args.levels.split(",")]).items():
        out = args.work / name
        if not (out / "manifest.json").is_file():
            quantize_export(args.fp32, out, options, check=False, progress=False, log=lambda _: None)
        results[name] = bench(out, args)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "quant_speed.json").write_text(json.dumps(results, indent=1))
    base = results["fp32"]["decode_tok_s"]
    print("| export | decode tok/s | vs fp32 | prefill tok/s | TTFT ms | peak RSS MB | size MB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base:.2f}x | {r['prefill_tok_s']:.0f} | "
              f"{r['ttft_ms']:.0f} | {r['peak_rss_mb']:.0f} | {r['mb']:.0f} |")


if __name__ == "__main__":
    main()
