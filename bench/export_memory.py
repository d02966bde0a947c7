"""Peak memory and wall time of `edgellm export` on bf16 Hugging Face checkpoints of Qwen2.5-0.5B / -1.5B shape.

    python bench/export_memory.py [--root build/bench] [--only q05b,q15b] [--max-seq 256] [--trace]

Builds each checkpoint once under ROOT/hf-bf16/<name> (random bf16 weights, seeded; config.json written by
transformers' Qwen2Config.save_pretrained, model.safetensors streamed tensor by tensor with the names and
layout transformers saves, the tied lm_head left out), then runs `python -m edgellm export DIR -o OUT
--max-seq 256 --no-progress` as a child process and reports its peak RSS (the kernel's high-water mark of the
child, `ru_maxrss` from wait4) against the model's float32 weight size, and the wall time. `--trace` also
samples the child's RSS every 0.2 s and prints it next to the export's log lines, which is how the phases
that hold copies were found. Recorded, not asserted. The 1.5B checkpoint is 3.1 GB on disk, its export 6 GB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (hidden, layers, heads, kv heads, ffn, vocab) - Qwen2.5-0.5B (= SHAPES["qwen2.5-0.5b"]) and -1.5B, tied
SHAPES = {
    "q05b": (896, 24, 14, 2, 4864, 151936),
    "q15b": (1536, 28, 12, 2, 8960, 151936),
}


def build(name: str, target: Path) -> Path:
    """config.json + model.safetensors (bf16) in `target`, unless already there."""
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dim, layers, heads, kv, ffn, vocab = SHAPES[name]
    config = Qwen2Config(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         bos_token_id=151643, eos_token_id=151643, dtype="bfloat16")
    with torch.device("meta"):
        meta = Qwen2ForCausalLM(config)
    tensors = {n: (tuple(t.shape)) for n, t in meta.state_dict().items() if n != "lm_head.weight"}
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    gen = torch.Generator().manual_seed(0)
    _write_safetensors(tmp / "model.safetensors", tensors, lambda n, s: _init(n, s, gen))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _init(name: str, shape: tuple[int, ...], gen) -> bytes:
    """One tensor's bf16 bytes: norms 1, everything else N(0, 0.02) (transformers' initializer_range)."""
    import torch

    t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
    return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], data) -> None:
    """The safetensors layout (u64 header length, JSON header, tensor bytes) written one tensor at a time, so
    building the 1.5B file holds one tensor, not the whole model."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * int(math.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in shapes.items():
            f.write(data(name, shape))


def fp32_bytes(directory: Path) -> int:
    """4 bytes per parameter of the model edgellm builds (the tied table counted once)."""
    header = json.loads((directory / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (directory / "model.safetensors").open("rb").read(8), "little")])
    return 4 * sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def mem_available_gb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1e6
    return float("inf")


# `--source DIR`: run the export of another source tree (e.g. `git archive COMMIT | tar -x -C DIR`, for a
# before/after figure) in this venv: its top-level folders mapped onto the package names as pyproject does
SHIM = """import importlib.util, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
import edgellm
for name, folder in (("runtime", "runtime"), ("quant", "quant"), ("export", "export")):
    spec = importlib.util.spec_from_file_location("edgellm." + name, f"{src}/{folder}/__init__.py",
                                                  submodule_search_locations=[f"{src}/{folder}"])
    module = sys.modules["edgellm." + name] = importlib.util.module_from_spec(spec)
    setattr(edgellm, name, module)
    spec.loader.exec_module(module)
from edgellm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_export(src: Path, out: Path, max_seq: int, trace: bool, guard_gb: float,
               source: Path | None = None) -> tuple[float, float, float, int]:
    """(peak RSS bytes, wall seconds, CPU seconds, exit code) of one export in a child process; the child is
    killed if the machine's available memory falls below `guard_gb` (other processes share it)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    prog = ["-m", "edgellm"] if source is None else ["-c", SHIM, str(source.resolve())]
    cmd = [sys.executable, *prog, "export", str(src), "-o", str(out), "--max-seq", str(max_seq)]
    cmd += [] if trace else ["--no-progress"]  # the trace shows the progress bar's updates as log lines
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, cwd=REPO)
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if mem_available_gb() < guard_gb:
                print(f"MemAvailable below {guard_gb} GB: killing the export", file=sys.stderr)
                child.kill()
            try:
                for line in open(f"/proc/{child.pid}/status"):
                    if line.startswith("VmRSS:"):
                        samples.append((time.perf_counter() - start, int(line.split()[1]) / 1e6))
            except OSError:
                pass
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log = []
    pending = b""
    while chunk := child.stderr.read1(1 << 16):  # the log and the progress bar's \r-ended updates, timestamped
        *parts, pending = re.split(rb"[\r\n]", pending + chunk)
        log += [(time.perf_counter() - start, p.decode(errors="replace").strip()) for p in parts if p.strip()]
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if trace:
        _print_trace(samples, log)
    elif child.returncode != 0:
        print("\n".join(text for _, text in log[-20:]), file=sys.stderr)
    return usage.ru_maxrss * 1024, wall, usage.ru_utime + usage.ru_stime, child.returncode


def _print_trace(samples: list[tuple[float, float]], log: list[tuple[float, str]]) -> None:
    """RSS over time (GB), every 2 s and at each log line, with the log lines in place."""
    events = sorted([(t, f"  | {text}") for t, text in log] +
                    [(t, f"{t:7.1f} s {rss:6.2f} GB") for i, (t, rss) in enumerate(samples) if i % 10 == 0])
    for _, text in events:
        print(text)
    if samples:
        t, rss = max(samples, key=lambda s: s[1])
        print(f"sampled peak {rss:.2f} GB at {t:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO / "build" / "bench")
    parser.add_argument("--only", default="q05b,q15b", help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--max-seq", type=int, default=256)
    parser.add_argument("--trace", action="store_true", help="print the RSS timeline next to the export log")
    parser.add_argument("--keep", action="store_true", help="keep the exports (default: deleted after)")
    parser.add_argument("--source", type=Path, default=None,
                        help="export with the edgellm source tree in DIR instead (e.g. an older commit's)")
    parser.add_argument("--guard-gb", type=float, default=1.5,
                        help="kill the export if the machine's MemAvailable drops below this (default 1.5)")
    args = parser.parse_args()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        src = build(name, args.root / "hf-bf16" / name)
        built = time.perf_counter() - t0
        weights = fp32_bytes(src)
        out = args.root / "export-memory" / name
        peak, wall, cpu, code = run_export(src, out, args.max_seq, args.trace, args.guard_gb, args.source)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{name}: fp32 weights {weights / 1e9:.2f} GB | export --max-seq {args.max_seq}: peak RSS "
              f"{peak / 1e9:.2f} GB = {peak / weights:.2f}x fp32 | {wall:.0f} s wall, {cpu:.0f} s CPU | {status}"
              + (f" (checkpoint built in {built:.0f} s)" if built > 1 else ""), flush=True)


if __name__ == "__main__":
    main()
