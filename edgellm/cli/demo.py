"""`edgellm demo`: the embedded default, end to end, with nothing to download.

Trains a small llama2-preset model on a corpus the package generates (or reuses the one in DIR), then runs
every later stage exactly as a user would type it — export -> quantize (int8, int4) -> run -> diff — printing
each command, so the demo doubles as a tour of the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from edgellm.runtime.errors import EdgeError

from . import integer, number

DEFAULT_OUT = Path("out/demo")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the embedded default model, then export, quantize, run and diff it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT, help=f"work directory (default {DEFAULT_OUT})")
    p.add_argument("--size", choices=("small", "tiny"), default="small",
                   help="small: the ~1M-parameter default (<= 3 min of training); tiny: seconds, for tests")
    p.add_argument("--budget", type=number, default=170.0, help="training time budget in seconds (default 170)")
    p.add_argument("--seed", type=integer, default=0, help="seed of the corpus, the model and the samples")
    p.add_argument("--retrain", action="store_true", help="train again even if DIR/model holds a trained model")
    p.set_defaults(func=run)


def _stage(title: str, argv: list[str], own_process: bool = False) -> None:
    """Run one verb as `edgellm ARGV`, showing the command; a failing stage ends the demo. `own_process`: in a
    fresh Python process, as a user on the board would run it, so its stats line (peak RSS above all) is the
    runtime's own, in a process that never imported torch, not this training process's."""
    from edgellm.cli import main

    print(f"\n== {title}\n$ edgellm {shlex.join(argv)}", flush=True)
    if own_process:
        code = subprocess.run([sys.executable, "-m", "edgellm", *argv], check=False).returncode
    else:
        code = main(argv)
    if code != 0:
        raise EdgeError(f"demo stage '{title}' failed (exit {code}); the command above reproduces it")


def _quiet_json(argv: list[str]) -> dict:
    """Run a verb that prints one JSON object and return it (used for the side-by-side samples)."""
    from edgellm.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    if code != 0:
        raise EdgeError(f"demo stage 'edgellm {shlex.join(argv)}' failed (exit {code})")
    return json.loads(buf.getvalue())


def _train(out: Path, args: argparse.Namespace) -> tuple[str, str]:
    """Train (or reuse) the model in out/model; returns (prompt, a description line)."""
    from edgellm.train.checkpoint import is_complete
    from edgellm.train.demo import train_demo

    model_dir = out / "model"
    info = out / "demo.json"
    if not args.retrain and is_complete(model_dir) and info.is_file():
        cached = json.loads(info.read_text())
        print(f"\n== train: reusing the trained model in {model_dir} (--retrain to train again)")
        return cached["prompt"], cached["line"]
    print(f"\n== train: generated stories -> byte-level BPE -> llama2-preset model ({args.size}, "
          f"budget {args.budget:.0f} s)", flush=True)
    result = train_demo(model_dir, budget_s=args.budget, seed=args.seed, size=args.size)
    line = (f"{result.n_params / 1e6:.2f}M params, val loss {result.val_loss:.3f} nats "
            f"(unigram entropy {result.unigram_entropy:.3f})")
    print(f"trained: {line}\nprompt : {result.prompt}\nsample : {result.sample}")
    info.write_text(json.dumps({"prompt": result.prompt, "line": line}))
    return result.prompt, line


def _eval_text(out: Path, seed: int) -> Path:
    """Held-out stories (another seed than training) for the accuracy diff."""
    from edgellm.train.corpus import generate_corpus

    path = out / "eval.txt"
    path.write_text("\n\n".join(generate_corpus(60, seed + 777)) + "\n", encoding="utf-8")
    return path


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    prompt, trained = _train(out, args)
    model, fp32, int8, int4, report = (str(out / n) for n in ("model", "fp32", "int8", "int4", "report"))

    _stage("export: static-KV ONNX graphs, verified against PyTorch",
           ["export", model, "-o", fp32])  # defaults: the model's context (<= 512), prefill chunks of 32
    _stage("quantize: int8 (AWQ, g32 blocks, fp16 scales)", ["quantize", fp32, "-o", int8, "--bits", "8"])
    _stage("quantize: int4 (the balanced profile: g32 blocks with offsets by llama.cpp's k-quant search, the "
           "table and the most sensitive linears int8)", ["quantize", fp32, "-o", int4, "--bits", "4"])
    _stage("run: the int4 export on onnxruntime (numpy + onnxruntime only, no torch: its own process)",
           ["run", int4, "--prompt", prompt, "--max-new-tokens", "60", "--temperature", "0.7", "--top-k", "20",
            "--seed", str(args.seed)], own_process=True)

    print("\n== the greedy continuation from each export (the same prompt; rounding may change where it goes):")
    for name, directory in (("fp32", fp32), ("int8", int8), ("int4", int4)):
        result = _quiet_json(["run", directory, "--prompt", prompt, "--max-new-tokens", "40",
                              "--temperature", "0", "--json"])
        stats = result["stats"]
        print(f"  [{name}] {result['text'].strip()}\n         ({stats['decode_tok_s']:.0f} tok/s decode)")

    _stage("diff: every export against the PyTorch model, per layer and on logits",
           ["diff", model, fp32, int8, int4, "-o", report, "--text", str(_eval_text(out, args.seed)),
            "--quiet"])

    print(f"\n== done in {time.perf_counter() - t0:.0f} s")
    print(f"model    : {out / 'model'}  ({trained})")
    print(f"exports  : {fp32}  {int8}  {int4}")
    print(f"report   : {report}/report.html")
    return 0
