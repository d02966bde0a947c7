"""Board half of bench/arm64_check.sh's row report (runtime only: numpy + onnxruntime): through the Engine the
runtime decodes with, is each S = 1 greedy decode step bit for bit that token's row of S = k + 1 verifications on
this CPU's kernels (what keeps greedy speculation exact; `--speculative auto` probes the same, runtime/speculative.py
`rows_exact_here`, and leaves greedy speculation off where it is not)?

    python3 bench/arm64_rows.py EXPORT_DIR     # prints one JSON line {"stack", "exact_rows", "rows_equal", ...}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from edgellm.runtime.engine import Engine
from edgellm.runtime.manifest import read_manifest

STEPS, K = 24, 6


def main(directory: Path) -> None:
    engine = Engine.open(directory, read_manifest(directory))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, engine.manifest.vocab_size, 20)]
    logits, fed, steps = engine.forward(prompt).copy(), [], []
    for _ in range(STEPS):
        fed.append(int(logits.argmax()))
        logits = engine.forward(fed[-1:]).copy()
        steps.append(logits)
    engine.cache.rewind(len(prompt))
    rows = np.concatenate([engine.few_rows(fed[i:i + K]).copy() for i in range(0, STEPS, K)])
    print(json.dumps({"stack": engine.stack_role, "exact_rows": engine.exact_rows,
                      "rows_equal": bool(np.array_equal(rows, np.stack(steps))),
                      "max_diff": float(np.abs(rows - np.stack(steps)).max())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
