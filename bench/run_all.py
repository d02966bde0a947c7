"""`make bench`: the README's speed/memory table — edgellm fp32 vs edgellm's PyTorch model on the anchor shapes.

    python bench/run_all.py [--root /tmp/edgellm-bench] [--models s15m,s110m,q05b] [--runs 3] [--json]

For each model: the random-weight HF checkpoint (bench/make_models.py), an fp32 export at max_seq 256
(`edgellm export --prefill-chunk 64`), then `edgellm bench --vs-torch` at 64 and the longest context that
fits. q05b is also exported at max_seq 2048 to show that a longer static cache barely slows decoding
(decode at 64 tokens vs the 256 export; decode at 1024 vs 64). ORT-genai: bench/ortgenai.py. Everything is
written under --root (several GB), never in the repository.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from stale import rebuild_if_stale

HERE = Path(__file__).resolve().parent
MODELS = ("s15m", "s110m", "q05b")


def ensure_export(root: Path, name: str, max_seq: int) -> Path:
    hf = root / "hf" / name
    if not (hf / "tokenizer.json").is_file():
        subprocess.run([sys.executable, str(HERE / "make_models.py"), str(root / "hf"), "--only", name], check=True)
    # the max_seq 256 export is the one bench/ortgenai.py uses too
    out = root / "exp" / (f"{name}-fp32" if max_seq == 256 else f"{name}-fp32-ms{max_seq}")
    rebuild_if_stale(out, lambda: subprocess.run(["edgellm", "export", str(hf), "-o", str(out), "--max-seq",
                                                  str(max_seq), "--prefill-chunk", "64", "--no-progress"], check=True))
    return out


def bench(export: Path, contexts: list[int], runs: int, vs_torch: Path | None) -> dict:
    cmd = ["edgellm", "bench", str(export), "--json", "--runs", str(runs), "--contexts", ",".join(map(str, contexts))]
    if vs_torch is not None:
        cmd += ["--vs-torch", str(vs_torch)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/tmp/edgellm-bench"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    report = []
    for name in args.models.split(","):
        export = ensure_export(args.root, name, 256)
        torch_ckpt = None if args.no_torch else args.root / "hf" / name
        report.append({"model": name, "max_seq": 256, **bench(export, [64, 128], args.runs, torch_ckpt)})
        if name == "q05b":
            long = ensure_export(args.root, name, 2048)
            report.append({"model": name, "max_seq": 2048, **bench(long, [64, 1024], args.runs, None)})
    if args.json:
        print(json.dumps({"schema": "edgellm-bench-all", "version": 1, "results": report}))
        return
    print("model   max_seq system    ctx  prefill tok/s          decode tok/s         overhead %   peak RSS MB")
    for res in report:
        for r in res["rows"]:
            over = f"{r['overhead_pct']['median']:.1f}" if r["overhead_pct"] else "-"
            print(f"{res['model']:<7} {res['max_seq']:>7} {r['system']:<8} {r['context']:>5}  "
                  f"{_spread(r['prefill_tok_s']):<22} {_spread(r['decode_tok_s']):<20} {over:>10} "
                  f"{r['peak_rss_mb']:>12.0f}")
        for ctx, ratio in res["vs_torch"].items():
            print(f"{'':16}ctx {ctx}: edgellm / PyTorch prefill {ratio['prefill']:.2f}x decode {ratio['decode']:.2f}x")


def _spread(s: dict) -> str:
    return f"{s['median']:.1f} ({s['low']:.1f}-{s['high']:.1f})"


if __name__ == "__main__":
    main()
