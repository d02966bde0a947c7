"""edgellm's speculative decoding against its peers' in ONE run: every system in its own worker process (each
loads its model once), the driver runs one case at a time, rotating the systems' order every task and round and
alternating plain / speculative, so all of them see the same machine minute by minute (the VM drifts 10-35 %).

    python bench/speculative_race.py EXPORT PEER [PEER ...] [--rounds 3] [--new-tokens 128] [--json FILE]

EXPORT: an edgellm export (its chat template gives every system the same prompt ids). PEER: an
onnxruntime-genai model directory (n-gram speculation, bench/speculative_peers.py) or a llama.cpp .gguf
(prompt lookup via llama-cpp-python). Prints per task the decode tok/s of each system plain and speculative
(median over rounds), and edgellm speculative / the best peer speculative per round (median, min-max). Fails
(exit 1) if edgellm's speculative tokens ever differ from its plain greedy tokens.

edgellm's "spec" column is `edgellm run --speculative auto` (greedy: lookup through the spare-row stack where this
machine computes a verification row bit for bit as a decode step, else the lone-row stack without drafts), its
"plain" column `--speculative off` (the lone-row stack): what a user gets either way (before 2026-11-28 both
columns ran the spare-row stack, lookup forced). Its worker starts as `edgellm run` does, with glibc asked for transparent huge pages
(edgellm/cli/hugepages.py); the peers run as shipped, unless --peers-huge-pages gives them the same variable.
Each worker's MiB in huge pages after loading is printed (before 2026-11-26 the edgellm worker ran without them:
its plain fp32 decode was 10-25 % slow).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

from speculative import TASKS


def _system(path: Path) -> str:
    if (path / "manifest.json").is_file():
        return "edgellm"
    if (path / "genai_config.json").is_file():
        return "genai"
    if path.suffix == ".gguf" and path.is_file():
        return "llama.cpp"
    raise SystemExit(f"{path}: expected an edgellm export, an onnxruntime-genai model directory or a .gguf")


def _open(path: Path, threads: int, k: int, draft_tokens: int | None):
    """{"plain": run, "spec": run}, run(ids, new_tokens) -> (decode tok/s, tokens, stats or None)."""
    kind = _system(path)
    if kind == "edgellm":
        from speculative import run_case

        from edgellm.cli.speculation import auto_mode, open_generator
        from edgellm.runtime.manifest import read_manifest
        from edgellm.runtime.session import SessionConfig

        # as `edgellm run` opens the export: "spec" is `--speculative auto` (the spare-row stack, lookup where this
        # machine's rows are exact, else the lone-row stack and no drafts), "plain" `--speculative off` (lone-row)
        config, manifest = SessionConfig(threads=threads, shared_pool=True), read_manifest(path)
        spec, known = open_generator(path, manifest, config, "auto", 0.0, "auto")
        plain, _ = open_generator(path, manifest, config, "auto", 0.0, "off")
        auto = auto_mode(spec.engine, known)
        return {"plain": lambda ids, n: run_case(plain, ids, "off", n, draft_tokens),
                "spec": lambda ids, n: run_case(spec, ids, auto, n, draft_tokens)}
    from speculative_peers import decode, genai_models

    if kind == "genai":
        runs = genai_models(path, threads, k)
        return {"plain": lambda ids, n: (*runs["plain"](ids, n), None),
                "spec": lambda ids, n: (*runs["lookup"](ids, n), None)}
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    llms = {"plain": Llama(**common),
            "spec": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))}
    return {mode: (lambda ids, n, llm=llm: (*decode(llm, ids, n), None)) for mode, llm in llms.items()}


def _worker(path: str, threads: int, k: int, draft_tokens: int | None, conn) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    runs = _open(Path(path), threads, k, draft_tokens)
    from edgellm.runtime.stats import huge_pages_mb

    conn.send(("ready", huge_pages_mb()))
    while (job := conn.recv()) is not None:
        mode, ids, n = job
        conn.send(runs[mode](ids, n))


def _start(ctx, path: Path, threads: int, k: int, draft_tokens: int | None, huge_pages: bool):
    """A worker process for one system (spawned: glibc reads its tunables as the new interpreter starts)."""
    from edgellm.cli.hugepages import environment_with_huge_pages

    saved = os.environ.get("GLIBC_TUNABLES")
    wanted = environment_with_huge_pages(os.environ).get("GLIBC_TUNABLES") if huge_pages else saved
    try:
        if wanted is not None:
            os.environ["GLIBC_TUNABLES"] = wanted
        parent, child = ctx.Pipe()
        ctx.Process(target=_worker, args=(str(path), threads, k, draft_tokens, child), daemon=True).start()
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved
    ready, huge = parent.recv()
    assert ready == "ready"
    print(f"  {path.name}: loaded, {huge:.0f} MiB in huge pages", file=sys.stderr)
    return parent, huge


def race(paths: list[Path], prompts: dict[str, list[int]], rounds: int, new_tokens: int, threads: int,
         k: int, peers_huge_pages: bool = False, draft_tokens: int | None = None) -> dict:
    ctx = mp.get_context("spawn")
    conns, huge = [], {}
    for i, p in enumerate(paths):
        conn, huge[str(p)] = _start(ctx, p, threads, k, draft_tokens, huge_pages=i == 0 or peers_huge_pages)
        conns.append(conn)
    names = [str(p) for p in paths]
    speeds = {t: {s: {"plain": [], "spec": []} for s in names} for t in TASKS}
    tokens: dict[str, dict[str, dict[str, list[int]]]] = {t: {s: {} for s in names} for t in TASKS}
    stats: dict[str, dict] = {}
    differ: dict[str, set[str]] = {s: set() for s in names}  # system -> tasks whose spec tokens != plain
    turn = 0
    for rnd in range(rounds + 1):  # round 0 warms up (not kept)
        for task, ids in prompts.items():
            for j in range(len(names)):
                i = (turn + j) % len(names)
                for mode in (("plain", "spec") if (turn + rnd) % 2 else ("spec", "plain")):
                    conns[i].send((mode, ids, new_tokens))
                    tok_s, got, st = conns[i].recv()
                    tokens[task][names[i]][mode] = got
                    if rnd:
                        speeds[task][names[i]][mode].append(tok_s)
                    if st is not None:
                        stats[task] = st
                if tokens[task][names[i]]["plain"] != tokens[task][names[i]]["spec"]:
                    differ[names[i]].add(task)
            turn += 1
        print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    for c in conns:
        c.send(None)
    same_as_edgellm = {t: {s: tokens[t][s]["plain"] == tokens[t][names[0]]["plain"] for s in names} for t in TASKS}
    return {"systems": names, "speeds": speeds, "stats": stats, "differ": {s: sorted(v) for s, v in differ.items()},
            "plain_same_as_edgellm": same_as_edgellm, "load": os.getloadavg(), "huge_pages_mb": huge}


def table(res: dict) -> list[str]:
    names, med = res["systems"], statistics.median
    short = [Path(s).name for s in names]
    lines = ["decode tok/s, plain / speculative (median of rounds); ratio: edgellm speculative / best peer "
             f"speculative per round, median (min-max); load avg {res['load'][0]:.1f}/{res['load'][2]:.1f}",
             "| task | group | " + " | ".join(short) + " | ratio |", "|---" * (len(names) + 3) + "|"]
    ratios: dict[str, list[float]] = {"grounded": [], "free": []}
    for task, (group, _) in TASKS.items():
        s = res["speeds"][task]
        per_round = [e / max(s[p]["spec"][r] for p in names[1:]) for r, e in enumerate(s[names[0]]["spec"])]
        ratios[group].append(med(per_round))
        cells = [f"{med(s[n]['plain']):.1f} / {med(s[n]['spec']):.1f}" for n in names]
        lines.append(f"| {task} | {group} | " + " | ".join(cells) +
                     f" | {med(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f}) |")
    for group, rs in ratios.items():
        lines.append(f"{group}: median ratio {med(rs):.2f}x (tasks {', '.join(f'{r:.2f}' for r in rs)})")
    lines.append("MiB in huge pages after loading: " + ", ".join(
        f"{Path(n).name} {res.get('huge_pages_mb', {}).get(n, 0):.0f}" for n in names))
    for name, tasks in res["differ"].items():
        lines.append(f"{Path(name).name}: speculative tokens " +
                     (f"differ from its plain ones on {', '.join(tasks)}" if tasks else "= its plain ones, every task"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("peers", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-pred-tokens", type=int, default=10, help="the peers' drafts per verification")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="edgellm's most drafts per verification (default: the runtime's DRAFT_TOKENS)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--peers-huge-pages", action="store_true",
                    help="start the peers with glibc asked for huge pages too (as edgellm's worker always is)")
    args = ap.parse_args()
    if _system(args.export) != "edgellm":
        raise SystemExit(f"{args.export}: the first argument must be an edgellm export")
    from edgellm.runtime.generator import Generator

    gen = Generator.open(args.export)
    prompts = {name: gen.chat_ids([{"role": "user", "content": text}]) for name, (_, text) in TASKS.items()}
    del gen
    res = race([args.export, *args.peers], prompts, args.rounds, args.new_tokens, args.threads,
               args.num_pred_tokens, args.peers_huge_pages, args.draft_tokens)
    for line in table(res):
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if res["differ"][str(args.export)]:
        sys.exit(1)


if __name__ == "__main__":
    main()
