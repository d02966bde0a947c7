"""The peers of bench/speculative.py on the same tasks and prompt ids: llama.cpp's prompt lookup
(llama-cpp-python's `LlamaPromptLookupDecoding`) vs its plain decoding, greedy, same threads.

    pip install --no-deps llama_cpp_python-0.3.x.whl diskcache      # bench only
    python bench/speculative_peers.py --ids-from EXPORT GGUF [GGUF ...] [--rounds 3] [--new-tokens 192]

The prompt ids come from the edgellm export's chat template (`--ids-from`), so both systems decode the very same
prompts. Decode tok/s = (new tokens - 1) / (last token time - first token time), as edgellm's stats count it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from speculative import TASKS


def decode(llm, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    out: list[int] = []
    first = last = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        last = time.perf_counter()
        if not out:
            first = last
        if token == llm.token_eos():
            break
        out.append(token)
        if len(out) >= new_tokens:
            break
    return (len(out) - 1) / max(last - first, 1e-9), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ggufs", nargs="+", type=Path)
    ap.add_argument("--ids-from", type=Path, required=True, help="an edgellm export of the same model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-pred-tokens", type=int, default=10)
    args = ap.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from edgellm.runtime.generator import Generator

    gen = Generator.open(args.ids_from)
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    del gen
    for gguf in args.ggufs:
        common = dict(model_path=str(gguf), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                      verbose=False)
        llms = {"plain": Llama(**common),
                "lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens))}
        speeds = {t: {"plain": [], "lookup": []} for t in TASKS}
        same = {t: True for t in TASKS}
        for rnd in range(args.rounds + 1):
            for name, ids in prompts.items():
                got = {}
                for mode in (("plain", "lookup") if rnd % 2 else ("lookup", "plain")):
                    tok_s, got[mode] = decode(llms[mode], ids, args.new_tokens)
                    if rnd:
                        speeds[name][mode].append(tok_s)
                same[name] &= got["plain"] == got["lookup"]
            print(f"  {gguf.name} round {rnd} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
        print(f"{gguf}  llama.cpp (llama-cpp-python), decode tok/s median of {args.rounds} rounds; "
              f"load avg {os.getloadavg()[0]:.1f}")
        ratios: dict[str, list[float]] = {"grounded": [], "free": []}
        for name, (group, _) in TASKS.items():
            s = speeds[name]
            r = statistics.median(b / a for a, b in zip(s["plain"], s["lookup"], strict=True))
            ratios[group].append(r)
            print(f"  {name:<10} {group:<9} plain {statistics.median(s['plain']):>7.1f}  lookup "
                  f"{statistics.median(s['lookup']):>7.1f}  {r:.2f}x{'' if same[name] else '  (tokens differ)'}")
        for group, rs in ratios.items():
            print(f"  {group}: median ratio {statistics.median(rs):.2f}x")


if __name__ == "__main__":
    main()
