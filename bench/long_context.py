"""Decode speed and peak RSS at long contexts, each export in a process of its own per run, alternating:

    python bench/long_context.py EXPORT [EXPORT ...] [--contexts 300,1800] [--rounds 2] [--lone]

The prompt is the first N ids of a text (GPL-3 by default) through the export's tokenizer, then --new-tokens
greedy tokens with speculation off (plain decoding, as the peers run it). `--lone`: also each export through its
lone-row stack (`SessionConfig(exact=False)`). Huge pages on (as `edgellm run` starts itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
from edgellm.runtime.generator import Generator
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig
export, n, new, exact, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
gen = Generator.open(export, config=SessionConfig(threads=2, shared_pool=True, exact=exact), verify=False)
ids = gen.tokenizer.encode(open(text).read())[:n]
r = gen.complete(ids, SamplingParams(temperature=0), StopParams(new), ignore_eos=True, text=False)
cache = sum(a.nbytes for a in gen.cache.keys + gen.cache.values)
print(json.dumps({"decode": r.timings.decode_tok_s, "rss": r.peak_rss_mb, "cache_mb": cache / 1e6,
                  "kv_dtype": gen.manifest.kv_dtype, "stack": gen.engine.stack_role}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exports", type=Path, nargs="+")
    p.add_argument("--contexts", default="300,1800")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lone", action="store_true")
    p.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    args = p.parse_args()
    cases = [(e, "1") for e in args.exports] + ([(e, "0") for e in args.exports] if args.lone else [])
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    for n in (int(c) for c in args.contexts.split(",")):
        runs: dict[tuple[Path, str], list[dict]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for export, exact in (cases if r % 2 == 0 else cases[::-1]):
                out = subprocess.run([sys.executable, "-c", CHILD, str(export), str(n), str(args.new_tokens), exact,
                                      str(args.text)], capture_output=True, text=True, env=env, check=True).stdout
                runs[(export, exact)].append(json.loads(out.strip().splitlines()[-1]))
        for (export, _), got in runs.items():
            d, m = [x["decode"] for x in got], [x["rss"] for x in got]
            print(f"context {n}  {export}  ({got[0]['kv_dtype']} cache {got[0]['cache_mb']:.1f} MB, {got[0]['stack']}): "
                  f"decode {min(d):.1f}-{max(d):.1f} (median {statistics.median(d):.1f}) tok/s, "
                  f"peak RSS {min(m):.0f}-{max(m):.0f} MB", flush=True)


if __name__ == "__main__":
    main()
