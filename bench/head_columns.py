"""What reading a split head's logits in the runtime (manifest format 12, `logit_columns`) saves against putting
them back in vocabulary order inside the graph (format 11: Shape + Expand of an [n, V] index + GatherElements).

    python bench/head_columns.py EXPORT [--rounds 8] [--new-tokens 128] [--threads 2]

EXPORT: an int4 export whose head is split by rows (`edgellm quantize --bits 4`, format 12). The script writes
a copy of it to a temporary directory with the format-11 head (the same weights, the three nodes added, the
manifest's `logit_columns` dropped), then
1. times the head graph alone at S = 1, 9 and 17 rows, both variants in one process, alternating;
2. decodes `--new-tokens` greedy tokens from 32 fixed prompt ids with speculation off through both exports
   (a Generator each, one process, the order alternating per round) and checks that the tokens are the same.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from edgellm.runtime.fileio import describe_files
from edgellm.runtime.generator import Generator
from edgellm.runtime.manifest import MANIFEST, read_manifest
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig


def restored_copy(src: Path, out: Path) -> None:
    """`src` with its head computing vocabulary order in the graph, as format 11 wrote it."""
    m = read_manifest(src)
    if m.logit_columns is None:
        raise SystemExit(f"{src}: its head computes vocabulary order already (no logit_columns): quantize with "
                         "--bits 4 (the default splits the head)")
    shutil.copytree(src, out)
    ids = np.fromfile(src / m.logit_columns, "<i4")
    head_file = m.graph("head", 1).file
    model = onnx.load(out / head_file, load_external_data=False)
    concat = next(n for n in model.graph.node if n.op_type == "Concat")
    logits = concat.output[0]
    concat.output[0] = "split_order"
    model.graph.initializer.append(numpy_helper.from_array(np.argsort(ids).astype(np.int32)[None, :], "pos_of_row"))
    model.graph.node.extend([helper.make_node("Shape", ["split_order"], ["split_shape"]),
                             helper.make_node("Expand", ["pos_of_row", "split_shape"], ["split_index"]),
                             helper.make_node("GatherElements", ["split_order", "split_index"], [logits], axis=-1)])
    onnx.save(model, out / head_file)
    (out / m.logit_columns).unlink()
    doc = json.loads((out / MANIFEST).read_text())
    del doc["logit_columns"]
    doc["format_version"] = 11
    doc["files"] = {rel: {"sha256": f.sha256, "bytes": f.bytes}
                    for rel, f in describe_files(out, [r for r in doc["files"] if r != m.logit_columns]).items()}
    (out / MANIFEST).write_text(json.dumps(doc, indent=1))


def head_session(directory: Path, threads: int) -> tuple[ort.InferenceSession, int]:
    m = read_manifest(directory, verify=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # two pools, one CPU budget
    return ort.InferenceSession(str(directory / m.graph("head", 1).file), options,
                                providers=["CPUExecutionProvider"]), m.dim


def time_heads(dirs: dict[str, Path], threads: int, rounds: int) -> None:
    sessions = {name: head_session(d, threads) for name, d in dirs.items()}
    for rows in (1, 9, 17):
        x = np.random.default_rng(0).standard_normal((1, rows, next(iter(sessions.values()))[1])).astype(np.float32)
        ms: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(rounds):
            for name, (s, _) in sessions.items():
                for _ in range(3):
                    s.run(None, {"hidden": x})
                calls = 40 if rows == 1 else 12
                start = time.perf_counter()
                for _ in range(calls):
                    s.run(None, {"hidden": x})
                ms[name].append((time.perf_counter() - start) / calls * 1e3)
        print(f"head graph, S = {rows}: " + ", ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in ms.items()))


def time_decode(dirs: dict[str, Path], threads: int, rounds: int, new_tokens: int) -> None:
    config = SessionConfig(threads=threads, shared_pool=True)
    gens = {name: Generator.open(d, config=config) for name, d in dirs.items()}
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 1000, 32)]
    speeds: dict[str, list[float]] = {name: [] for name in gens}
    tokens: dict[str, list[int]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name in (list(gens) if r % 2 == 0 else list(gens)[::-1]):
            gens[name].speculate("off")
            res = gens[name].complete(prompt, SamplingParams(temperature=0), StopParams(new_tokens), ignore_eos=True,
                                      text=False)
            tokens[name] = res.token_ids
            if r:
                speeds[name].append(res.timings.decode_tok_s)
    a, b = list(gens)
    ratios = [y / x for x, y in zip(speeds[a], speeds[b], strict=True)]
    print(f"decode, {new_tokens} tokens, {rounds} rounds: {a} {statistics.median(speeds[a]):.1f} tok/s, {b} "
          f"{statistics.median(speeds[b]):.1f} tok/s, {b} / {a} median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}); same tokens: {tokens[a] == tokens[b]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="head-columns-") as tmp:
        old = Path(tmp) / "format11"
        restored_copy(args.export, old)
        dirs = {"in-graph (11)": old, "runtime (12)": args.export}
        time_heads(dirs, args.threads, args.rounds)
        time_decode(dirs, args.threads, args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
