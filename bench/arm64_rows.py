"""Board half of bench/arm64_check.sh's row report (runtime only: numpy + onnxruntime): through the Engine the
runtime decodes with, is each S = 1 greedy decode step bit for bit that token's row of a verification on this CPU's
kernels? The runtime's own probe (runtime/speculative.py `rows_exact_here`, what `--speculative auto` runs before it
speculates greedily) on an empty cache.

    python3 bench/arm64_rows.py EXPORT_DIR     # prints one JSON line {"stack", "exact_rows", "rows_equal", "max_diff"}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edgellm.runtime.engine import Engine
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.session import SessionConfig
from edgellm.runtime.speculative import rows_exact_here


def main(directory: Path) -> None:
    engine = Engine.open(directory, read_manifest(directory), SessionConfig(exact=True))
    equal, diff = rows_exact_here(engine)
    print(json.dumps({"stack": engine.stack_role, "exact_rows": engine.exact_rows, "rows_equal": equal,
                      "max_diff": diff}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
