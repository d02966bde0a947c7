"""edgellm vs onnxruntime-genai on the same Hugging Face checkpoints, same precision, same workload.

    pip install -e '.[bench]'        # onnxruntime-genai (bench-only extra)
    python bench/ortgenai.py [--models s15m,s110m,q05b] [--precision fp32] [--root /tmp/edgellm-bench] [--rounds 5]
                             [--llamacpp] [--profile balanced|small] [--hf NAME=DIR]

For each model: builds the random-weight HF checkpoint if missing (bench/make_models.py; `--hf NAME=DIR` names a
real checkpoint's directory instead), the ORT-genai model
(`python -m onnxruntime_genai.models.builder -i HF -o OUT -p PREC -e cpu`, then intra_op_num_threads and
past_present_share_buffer set in genai_config.json) and the edgellm export (`edgellm export`, plus
`edgellm quantize` for int8/int4), then runs the anchors' workload on both — fixed pseudo-random prompt ids
(seed 1234), greedy, EOS unable to stop a run, plain decoding (edgellm `--speculative off`: the peers do not
speculate here, and a random-weight model's repetitive output would flatter prompt lookup), one warm-up +
--runs timed runs, medians — each system in its own process (own peak RSS), and prints the table and the
edgellm / ORT-genai ratios. With --rounds N the pair is run N times, alternating which system goes first, and the median of the N decode ratios is printed: this
VM's speed drifts by 10-20 % over minutes, so one pair of runs can land anywhere in 0.8-1.05x.
`--llamacpp` adds llama.cpp in the same rotation (llama-cpp-python, bench extra): the checkpoint converted by its
sdist's convert_hf_to_gguf.py and quantized by llama.cpp itself (fp32: f32, int8: Q8_0, int4: Q4_0), decoded
greedily by bench/quality_llamacpp.py's eval loop (one Python call per token) in a child process of its own.
The "edgellm" row decodes through the stack a greedy `edgellm run` opens on this machine (`--exact-decode auto`:
the spare-row stack where its verification rows are exact here, the lone-row one where this CPU's kernels make
them differ anyway). `--lone` adds edgellm once more as "edgellm-lone" (`edgellm bench --exact-decode off`: the
lone-row stack, what a sampled `edgellm run` decodes with; greedy here like every system, its tokens then not bit
for bit speculation's): the price of exact greedy speculation, measured beside the peers.
Timings of the edgellm export and quantize steps are printed when they run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stale import rebuild_if_stale

HERE = Path(__file__).resolve().parent
PRECISIONS = ("fp32", "int8", "int4")


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")


def build_genai(hf: Path, out: Path, precision: str, threads: int, max_length: int) -> Path:
    if not (out / "genai_config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
              "-p", precision, "-e", "cpu"], out.with_suffix(".log"))
    path = out / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config["model"]["context_length"] = max(config["model"]["context_length"], max_length)
    config["search"].update(past_present_share_buffer=True, max_length=max_length)
    path.write_text(json.dumps(config, indent=2))
    return out


def _timed(cmd: list[str], log: Path) -> None:
    start = time.perf_counter()
    _run(cmd, log)
    print(f"  {' '.join(cmd[:2])} {Path(cmd[2]).name}: {time.perf_counter() - start:.0f} s", flush=True)


def build_edgellm(hf: Path, out: Path, precision: str, max_seq: int, kv_dtype: str | None = None,
                  lm_head: str | None = None, profile: str | None = None) -> Path:
    """`edgellm export` (+ `quantize`) with the defaults a user gets (`kv_dtype` None: the fp32 export's fp32
    cache, quantize's `auto` one: fp32 at max_seq 256); else that cache type: float16 `export --kv-dtype float16` (the directories end
    in -kv16), float32 / int8 `quantize --kv-dtype` (the quantized one ends in -kv32 / -kv8). `lm_head`: quantize's
    `--lm-head` (the quantized directory ends in -head4 / -head8); `profile`: quantize's `--profile` (-small)."""
    export_kv = "float16" if kv_dtype == "float16" else "float32"
    if kv_dtype is not None:
        out = out.with_name(out.name + {"float16": "-kv16", "float32": "-kv32", "int8": "-kv8"}[kv_dtype])
    fp32 = out.with_name(out.name.replace(f"-{precision}", "-fp32").removesuffix("-kv8").removesuffix("-kv32"))
    if lm_head is not None and precision != "fp32":
        out = out.with_name(f"{out.name}-head{lm_head.removeprefix('int')}")
    if profile is not None and precision != "fp32":
        out = out.with_name(f"{out.name}-{profile}")
    rebuilt = rebuild_if_stale(fp32, lambda: _timed(["edgellm", "export", str(hf), "-o", str(fp32), "--max-seq",
                                                     str(max_seq), "--prefill-chunk", "64", "--kv-dtype", export_kv,
                                                     "--no-progress"], fp32.with_suffix(".log")))
    if precision == "fp32":
        return fp32
    bits = {"int8": "8", "int4": "4"}[precision]
    more = ["--kv-dtype", kv_dtype] if kv_dtype in ("float32", "int8") else []
    more += ["--lm-head", lm_head] if lm_head is not None else []
    more += ["--profile", profile] if profile is not None else []
    rebuild_if_stale(out, lambda: _timed(["edgellm", "quantize", str(fp32), "-o", str(out), "--bits", bits, *more,
                                          "--no-progress"], out.with_suffix(".log")), source_rebuilt=rebuilt,
                     quantize_flags=["--bits", bits, *more])
    return out


LLAMACPP_TYPES = {"fp32": None, "int8": "Q8_0", "int4": "Q4_0"}


def build_gguf(hf: Path, root: Path, name: str, precision: str) -> Path:
    """The checkpoint through llama.cpp's own converter and quantizer (bench/quality_llamacpp.py)."""
    import quality_llamacpp as L

    f32 = L.convert_f32(hf, root / "gguf" / f"{name}-f32.gguf", L.converter(root), any_tokenizer=True)
    kind = LLAMACPP_TYPES[precision]
    return f32 if kind is None else L.quantize(f32, root / "gguf" / f"{name}-{kind}.gguf", kind)


def llamacpp_child(gguf: str, contexts: list[int], new_tokens: int, runs: int, threads: int) -> list[dict]:
    """Runs inside a child process: greedy decode through llama-cpp-python (decode tok/s, peak RSS)."""
    import quality_llamacpp as L

    from edgellm.runtime.stats import peak_rss_mb

    rows = []
    for context in contexts:
        speed = L.decode_speed(Path(gguf), threads, prompt=context, new=new_tokens, runs=runs)
        rows.append({"system": "llama.cpp", "context": context, "prefill": float("nan"),
                     "prefill_range": [float("nan")] * 2, "decode": speed, "decode_range": [speed, speed],
                     "peak_rss_mb": peak_rss_mb(), "first": [], "other_load_pct": None})
    return rows


def genai_child(model_dir: str, contexts: list[int], new_tokens: int, runs: int, max_load: float) -> list[dict]:
    """Runs inside a child process: the workload through onnxruntime-genai."""
    import onnxruntime_genai as og

    from edgellm.cli.bench_measure import bench_prompt, timed_runs
    from edgellm.runtime.stats import peak_rss_mb

    model = og.Model(model_dir)
    vocab = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["vocab_size"]
    rows = []
    for context in contexts:
        prompt = bench_prompt(context, vocab)

        def once(prompt: list[int] = prompt, context: int = context) -> tuple:
            params = og.GeneratorParams(model)
            total = context + new_tokens
            params.set_search_options(max_length=total, min_length=total, do_sample=False)
            gen = og.Generator(model, params)
            start = time.perf_counter()
            gen.append_tokens(prompt)
            ids: list[int] = []
            while len(ids) < new_tokens:
                gen.generate_next_token()
                ids.append(int(gen.get_next_tokens()[0]))
                if len(ids) == 1:
                    first = time.perf_counter()
            last = time.perf_counter()
            return context / (first - start), (new_tokens - 1) / (last - first), ids

        kept, load = timed_runs(once, runs, max_load)
        prefill, decode, ids = [k[0] for k in kept], [k[1] for k in kept], kept[-1][2]
        rows.append({"system": "ort-genai", "context": context, "prefill": statistics.median(prefill),
                     "prefill_range": [min(prefill), max(prefill)], "decode": statistics.median(decode),
                     "decode_range": [min(decode), max(decode)], "peak_rss_mb": peak_rss_mb(), "first": ids[:8],
                     "other_load_pct": load})
    return rows


def edgellm_rows(export: Path, contexts: list[int], new_tokens: int, runs: int, threads: int,
                 max_load: float, lone: bool = False) -> list[dict]:
    out = json.loads(subprocess.run(
        ["edgellm", "bench", str(export), "--json", "--threads", str(threads), "--runs", str(runs), "--new-tokens",
         str(new_tokens), "--contexts", ",".join(map(str, contexts)), "--max-other-load", str(max_load),
         "--speculative", "off",  # plain decoding, as the peers run here (speculation: bench/speculative_race.py)
         # auto: the stack a greedy `edgellm run` decodes through here (the spare-row one where this CPU's rows are
         # exact, else the lone-row one: edgellm/cli/speculation.py)
         "--exact-decode", "off" if lone else "auto"],
        capture_output=True, text=True, check=True).stdout)
    rows = []
    for r in out["rows"]:
        rows.append({"system": "edgellm-lone" if lone else "edgellm", "context": r["context"], "prefill": r["prefill_tok_s"]["median"],
                     "prefill_range": [r["prefill_tok_s"]["low"], r["prefill_tok_s"]["high"]],
                     "decode": r["decode_tok_s"]["median"],
                     "decode_range": [r["decode_tok_s"]["low"], r["decode_tok_s"]["high"]],
                     "overhead_pct": r["overhead_pct"]["median"], "peak_rss_mb": r["peak_rss_mb"],
                     "first": r["first_tokens"], "other_load_pct": r["foreign_load_pct"],
                     "huge_pages_mb": out["huge_pages_mb"]})  # the packed weights in huge pages, or not: +-20 %
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="s15m,s110m,q05b")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--root", type=Path, default=Path("/tmp/edgellm-bench"), help="scratch dir (not the repo)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--contexts", default="64")
    p.add_argument("--max-seq", type=int, default=256, help="edgellm export context / genai max_length")
    p.add_argument("--max-other-load", type=float, default=3.0,
                   help="repeat a timed run (up to 5 times) while other processes use more CPU than this %%")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the pair of runs this many times, alternating which system goes first (the VM's "
                        "speed drifts over minutes); prints the median of the per-round ratios")
    p.add_argument("--llamacpp", action="store_true", help="llama.cpp (f32 / Q8_0 / Q4_0) in the rotation too")
    p.add_argument("--lone", action="store_true", help="edgellm through its lone-row stack in the rotation too")
    p.add_argument("--kv-dtype", choices=("float32", "float16", "int8"), default=None,
                   help="edgellm's export with this KV cache type (default: what a user gets, an fp32 cache in "
                        "the fp32 export, quantize's auto in the quantized ones (fp32 at max_seq 256); float16: `edgellm export --kv-dtype`; "
                        "float32 / int8: `edgellm quantize --kv-dtype`, quantized precisions only)")
    p.add_argument("--lm-head", choices=("int8", "int4"), default=None,
                   help="edgellm quantize --lm-head (default: what a user gets; onnxruntime-genai's int4 has an int4 "
                        "lm_head, g32 at accuracy level 4)")
    p.add_argument("--profile", choices=("balanced", "small"), default=None,
                   help="edgellm quantize --profile (default: what a user gets, balanced; small: the Q4_0-class int4)")
    p.add_argument("--hf", action="append", default=[], metavar="NAME=DIR",
                   help="model NAME is the Hugging Face directory DIR (a real checkpoint) instead of make_models' "
                        "random weights, e.g. --models smollm2 --hf smollm2=/path/to/SmolLM2-135M-Instruct")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    p.add_argument("--llamacpp-child", nargs=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(genai_child(args.child[0], contexts, args.new_tokens, args.runs, args.max_other_load)))
        return
    if args.llamacpp_child:
        print(json.dumps(llamacpp_child(args.llamacpp_child[0], contexts, args.new_tokens, args.runs, args.threads)))
        return
    report = []
    given = dict(_named_dir(spec) for spec in args.hf)
    for name in args.models.split(","):
        hf = given.get(name, args.root / "hf" / name)
        if name not in given and not (hf / "tokenizer.json").is_file():
            _run([sys.executable, str(HERE / "make_models.py"), str(args.root / "hf"), "--only", name],
                 args.root / f"make_{name}.log")
        genai = build_genai(hf, args.root / "genai" / f"{name}-{args.precision}", args.precision, args.threads,
                            args.max_seq)
        export = build_edgellm(hf, args.root / "exp" / f"{name}-{args.precision}", args.precision, args.max_seq,
                               args.kv_dtype, args.lm_head, args.profile)
        gguf = build_gguf(hf, args.root, name, args.precision) if args.llamacpp else None
        systems = ["ort-genai", "edgellm"] + (["edgellm-lone"] if args.lone else []) + (["llama.cpp"] if gguf else [])
        ratios: dict[tuple[str, str, int], list[float]] = {}
        for round_ in range(args.rounds):
            rows = []
            for k in range(len(systems)):
                system = systems[(round_ + k) % len(systems)]  # each round starts with the next system
                if system == "ort-genai":
                    rows += _genai_rows(genai, args)
                elif system == "llama.cpp":
                    rows += _llamacpp_rows(gguf, args)
                else:
                    rows += edgellm_rows(export, contexts, args.new_tokens, args.runs, args.threads,
                                         args.max_other_load, lone=system == "edgellm-lone")
            rows.sort(key=lambda r: systems.index(r["system"]))
            for row in rows:
                row["model"], row["precision"], row["round"] = name, args.precision, round_
            report += rows
            for key, ratio in _decode_ratios(rows).items():
                ratios.setdefault(key, []).append(ratio)
            if not args.json:
                _print(name, args.precision, rows)
        if args.rounds > 1 and not args.json:
            for (ours, peer, ctx), values in ratios.items():
                print(f"  ctx {ctx}: decode {ours} / {peer} over {len(values)} rotating rounds: median "
                      f"{statistics.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in sorted(values))})")
    if args.json:
        print(json.dumps({"schema": "edgellm-bench-ortgenai", "version": 1, "rows": report}))


def _named_dir(spec: str) -> tuple[str, Path]:
    name, sep, directory = spec.partition("=")
    if not sep or not name or not (Path(directory) / "config.json").is_file():
        sys.exit(f"--hf {spec}: expected NAME=DIR with DIR a Hugging Face directory (config.json, safetensors)")
    return name, Path(directory)


def _genai_rows(genai: Path, args: argparse.Namespace) -> list[dict]:
    """onnxruntime-genai's rows, measured in a child process of its own (own peak RSS)."""
    child = subprocess.run([sys.executable, __file__, "--child", str(genai), "--contexts", args.contexts,
                            "--runs", str(args.runs), "--new-tokens", str(args.new_tokens),
                            "--max-other-load", str(args.max_other_load)], capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def _llamacpp_rows(gguf: Path, args: argparse.Namespace) -> list[dict]:
    child = subprocess.run([sys.executable, __file__, "--llamacpp-child", str(gguf), "--contexts", args.contexts,
                            "--runs", str(args.runs), "--new-tokens", str(args.new_tokens), "--threads",
                            str(args.threads)], capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def _decode_ratios(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    """(edgellm system, peer, context) -> its decode tok/s / the peer's within one round."""
    by = {(r["system"], r["context"]): r["decode"] for r in rows}
    return {(ours, peer, ctx): by[(ours, ctx)] / by[(peer, ctx)] for ours, ctx in by if ours.startswith("edgellm")
            for peer, c in by if c == ctx and not peer.startswith("edgellm")}


def _print(name: str, precision: str, rows: list[dict]) -> None:
    print(f"\n{name} {precision}: system, ctx, prefill tok/s, decode tok/s (median (min-max)), peak RSS MB")
    for r in rows:
        print(f"  {r['system']:<12} {r['context']:>5}  {r['prefill']:8.1f} ({r['prefill_range'][0]:.0f}-"
              f"{r['prefill_range'][1]:.0f})  {r['decode']:8.1f} ({r['decode_range'][0]:.1f}-"
              f"{r['decode_range'][1]:.1f})  {r['peak_rss_mb']:7.0f}  first ids {r['first'][:4]}  other load "
              f"{r['other_load_pct'] if r['other_load_pct'] is not None else float('nan'):.1f}%"
              + (f"  huge pages {r['huge_pages_mb']:.0f} MB" if "huge_pages_mb" in r else ""))
    for ctx in sorted({r["context"] for r in rows}):
        for e in (r for r in rows if r["system"].startswith("edgellm") and r["context"] == ctx):
            for g in (r for r in rows if not r["system"].startswith("edgellm") and r["context"] == ctx):
                print(f"  ctx {ctx}: {e['system']} / {g['system']}  prefill {e['prefill'] / g['prefill']:.2f}x  "
                      f"decode {e['decode'] / g['decode']:.2f}x  RSS {e['peak_rss_mb'] / g['peak_rss_mb']:.2f}x")


if __name__ == "__main__":
    main()
