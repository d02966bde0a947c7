"""PyTorch eager as users run it: Hugging Face `transformers`, the issue's "PyTorch eager" reference.

    python bench/hf_eager.py [--models s15m,s110m,q05b] [--root /tmp/edgellm-bench] [--runs 3] [--json]

The same random-weight checkpoints as bench/run_all.py and bench/ortgenai.py (bench/make_models.py), the
same workload: fixed pseudo-random 64-token prompt (seed 1234), 128 greedy tokens with EOS unable to stop
the run, one warm-up + --runs timed runs, medians. The loop is the model's own forward with a DynamicCache
and argmax (the fastest eager variant in research/anchors-perf.md; `generate()` adds its own overhead),
`attn_implementation="eager"`, fp32, torch threads = --threads. Prints prefill and decode tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODELS = ("s15m", "s110m", "q05b")


def run_once(model, prompt, new_tokens: int) -> tuple[float, float]:
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
    return prompt.shape[1] / (t1 - t0), (new_tokens - 1) / (t2 - t1)


def bench(path: Path, context: int, new_tokens: int, runs: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=gen)
    run_once(model, prompt, 8)  # warm-up
    results = [run_once(model, prompt, new_tokens) for _ in range(runs)]
    prefill, decode = zip(*results, strict=True)
    return {"system": "pytorch-hf-eager", "context": context, "prefill": statistics.median(prefill),
            "prefill_range": [min(prefill), max(prefill)], "decode": statistics.median(decode),
            "decode_range": [min(decode), max(decode)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--root", type=Path, default=Path("/tmp/edgellm-bench"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        hf = args.root / "hf" / name
        if not (hf / "config.json").is_file():
            raise SystemExit(f"{hf}: missing; build it with bench/make_models.py")
        rows.append({"model": name, **bench(hf, args.context, args.new_tokens, args.runs)})
    if args.json:
        print(json.dumps({"schema": "edgellm-bench-hf-eager", "version": 1, "rows": rows}))
        return
    for r in rows:
        print(f"{r['model']:<6} HF eager fp32  ctx {r['context']}  prefill {r['prefill']:.1f} tok/s  "
              f"decode {r['decode']:.2f} ({r['decode_range'][0]:.2f}-{r['decode_range'][1]:.2f}) tok/s")


if __name__ == "__main__":
    main()
