"""Board half of bench/arm64_check.sh's mismatch check (runtime only: numpy + onnxruntime): the logits this CPU
computes before each of the host's greedy tokens (teacher-forced: the host's prompt and tokens in one forward), so
the host can tell a token the board chose otherwise at a near-tie (its top two within what the two machines'
kernels differ by) from a wrong computation.

    python3 bench/arm64_logits.py EXPORT_DIR HOST_JSON     # prints one JSON line {"rows": [[logit, ...], ...]}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edgellm.runtime.engine import Engine
from edgellm.runtime.manifest import read_manifest


def main(directory: Path, host_json: Path) -> None:
    run = json.loads(host_json.read_text())
    prompt, tokens = run["prompt_ids"], run["token_ids"]
    rows = Engine.open(directory, read_manifest(directory)).forward_rows(prompt + tokens[:-1])[len(prompt) - 1:]
    print(json.dumps({"rows": rows.tolist()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
