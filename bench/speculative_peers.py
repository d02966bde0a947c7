"""The peers of bench/speculative.py on the same tasks and prompt ids, each speculative vs its own plain decoding,
greedy, same threads: llama.cpp's prompt lookup (llama-cpp-python's `LlamaPromptLookupDecoding`) for a .gguf,
onnxruntime-genai 0.18's n-gram decoding (`set_speculative_options(ngram_size=3, max_draft_tokens=K)`,
adaptive K) for a genai model directory (bench/ortgenai.py builds them with its model builder).

    pip install --no-deps llama_cpp_python-0.3.x.whl diskcache onnxruntime-genai==0.18.0   # bench only
    python bench/speculative_peers.py --ids-from EXPORT MODEL [MODEL ...] [--rounds 3] [--new-tokens 192]

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


def genai_decode(model, ids: list[int], new_tokens: int, ngram: bool, k: int) -> tuple[float, list[int]]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens + 16, do_sample=False)
    if ngram:
        params.set_speculative_options(ngram_size=3, max_draft_tokens=k)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    eos = set(model_eos(model))
    out: list[int] = []
    first = last = time.perf_counter()
    while not gen.is_done() and len(out) < new_tokens:
        gen.generate_next_token()
        last = time.perf_counter()
        seq = list(gen.get_sequence(0))[len(ids):]
        if not out:
            first = last
        done = [t for t in seq[len(out):]]
        stop = next((i for i, t in enumerate(done) if t in eos), None)
        out += done[:stop]
        if stop is not None:
            break
    out = out[:new_tokens]
    return (len(out) - 1) / max(last - first, 1e-9), out


def model_eos(model) -> list[int]:
    return [2]  # SmolLM2's <|im_end|>; genai stops on its config's eos itself


def genai_models(directory: Path, threads: int, k: int):
    import json

    import onnxruntime_genai as og

    path = directory / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config["search"]["past_present_share_buffer"] = True
    path.write_text(json.dumps(config, indent=2))
    model = og.Model(str(directory))
    return {"plain": lambda ids, n: genai_decode(model, ids, n, False, k),
            "lookup": lambda ids, n: genai_decode(model, ids, n, True, k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ggufs", nargs="+", type=Path)
    ap.add_argument("--ids-from", type=Path, required=True, help="an edgellm export of the same model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-pred-tokens", type=int, default=10, help="drafts per verification (both peers)")
    args = ap.parse_args()
    if not all(m.is_dir() for m in args.ggufs):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from edgellm.runtime.generator import Generator

    gen = Generator.open(args.ids_from)
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    del gen
    for gguf in args.ggufs:
        if gguf.is_dir():
            runs, system = genai_models(gguf, args.threads, args.num_pred_tokens), "onnxruntime-genai"
        else:
            common = dict(model_path=str(gguf), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                          verbose=False)
            llms = {"plain": Llama(**common), "lookup": Llama(
                **common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens))}
            runs = {mode: (lambda ids, n, llm=llm: decode(llm, ids, n)) for mode, llm in llms.items()}
            system = "llama.cpp (llama-cpp-python)"
        speeds = {t: {"plain": [], "lookup": []} for t in TASKS}
        same = {t: True for t in TASKS}
        for rnd in range(args.rounds + 1):
            for name, ids in prompts.items():
                got = {}
                for mode in (("plain", "lookup") if rnd % 2 else ("lookup", "plain")):
                    tok_s, got[mode] = runs[mode](ids, args.new_tokens)
                    if rnd:
                        speeds[name][mode].append(tok_s)
                same[name] &= got["plain"] == got["lookup"]
            print(f"  {gguf.name} round {rnd} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
        print(f"{gguf}  {system}, decode tok/s median of {args.rounds} rounds; "
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
