"""Decode tok/s of edgellm's quantized exports vs llama.cpp's GGUFs of the same model, each pair back to back, the order
alternating between rounds.

    python bench/quant_speed_llamacpp.py ROOT [THREADS] [ROUNDS]   (ROOT: bench/quant_vs_llamacpp.py's --root, built)

edgellm: `edgellm bench` (64-token prompt, 128 new tokens, median of 3; the stack a greedy `edgellm run` opens on
this machine, printed); llama.cpp: llama-cpp-python's eval loop on the same prompt (quality_llamacpp.decode_speed,
which includes a Python call and an argmax over the logits per token; ROOT/gguf/*-PEER.gguf). Pairs: each default against its
class's peer (int8 / Q8_0, `balanced` int4 / Q4_K_M, `small` / Q4_0). Prints each ratio, the load average and the
median ratio per pair.
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_llamacpp as L  # noqa: E402

root = Path(sys.argv[1])
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
pairs = [("int8", "Q8_0"), ("int4", "Q4_K_M"), ("int4-small", "Q4_0")]


def edgellm(directory: Path) -> tuple[float, str]:
    done = subprocess.run([sys.executable, "-m", "edgellm", "bench", str(directory), "--json", "--contexts", "64",
                           "--new-tokens", "128", "--runs", "3", "--threads", str(threads)],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    return float(report["rows"][0]["decode_tok_s"]["median"]), report["stack"]


res: dict = {}
for r in range(rounds):
    for i, (ours, peer) in enumerate(pairs):
        gguf = next((root / "gguf").glob(f"*-{peer}.gguf"), None)
        if gguf is None:
            sys.exit(f"quant_speed_llamacpp: no {root / 'gguf'}/*-{peer}.gguf (run bench/quant_vs_llamacpp.py first)")
        if (r + i) % 2 == 0:
            (a, stack), b = edgellm(root / "edgellm" / ours), L.decode_speed(gguf, threads)
        else:
            b = L.decode_speed(gguf, threads)
            a, stack = edgellm(root / "edgellm" / ours)
        res.setdefault((ours, peer), []).append((a, b))
        print(f"round {r} {ours} ({stack}) {a:.1f} vs {peer} {b:.1f}  ratio {a / b:.2f}  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
for (ours, peer), v in res.items():
    print(f"{ours} vs {peer}: ratios {[round(a / b, 2) for a, b in v]} "
          f"median {statistics.median(a / b for a, b in v):.2f}")
