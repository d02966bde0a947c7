"""Decode tok/s of edgellm's quantized SmolLM2 exports vs llama.cpp's GGUFs, in alternating rounds.

    python bench/quant_speed_llamacpp.py ROOT [THREADS]     (ROOT: bench/quant_vs_llamacpp.py's --root, built)

edgellm: `edgellm bench` (64-token prompt, 128 new tokens, median of 3); llama.cpp: llama-cpp-python's eval
loop on the same prompt (quality_llamacpp.decode_speed, which includes a Python call and an argmax over the
49152 logits per token). Two rounds, each pair measured back to back; prints each ratio and the load average.
"""
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_llamacpp as L  # noqa: E402
import quant_vs_llamacpp as q  # noqa: E402

root = Path(sys.argv[1])
th = int(sys.argv[2]) if len(sys.argv) > 2 else 2
pairs = [("int8", "Q8_0"), ("int4", "Q4_0"), ("int4-head4", "Q4_0")]
res: dict = {}
for r in range(2):
    for ours, peer in pairs:
        a = q.edgellm_speed(root / "edgellm" / ours, th)
        b = L.decode_speed(root / "gguf" / f"smollm2-{peer}.gguf", th)
        res.setdefault((ours, peer), []).append((a, b))
        print(f"round {r} {ours} {a:.1f} vs {peer} {b:.1f}  ratio {a / b:.2f}  load {os.getloadavg()[0]:.1f}",
              flush=True)
for (ours, peer), v in res.items():
    print(f"{ours} vs {peer}: ratios {[round(a / b, 2) for a, b in v]} "
          f"median {statistics.median(a / b for a, b in v):.2f}")
