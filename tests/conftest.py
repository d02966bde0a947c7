"""Every test process (xdist workers too) keeps its caches in a directory of its own, removed at exit: what one
run remembers (runtime/rows_memo.py: whether this machine's rows are exact for an export) never leaks into the
user's home or into another run. The wheel cache of the real-weight tests (~/.cache/edgellm/wheels) stays."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="edgellm-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


# `make test` deals whole files to the workers (--dist loadfile) in collection order, with xdist's own reordering
# (by test count, which deals the single-test real-weight files last and leaves one worker running them alone
# for the suite's last minutes) switched off: the heaviest files go first and the rest fill in around them.
# Seconds per file in one 2-core run (2026-11-28): 168, 128, 117, 114, 109, 87, 66, 65, 65, 59, 58, 57.
HEAVY_FIRST = ("test_gguf_gemma3_real.py", "test_gguf_smollm2.py", "test_export_parity.py", "test_arm64.py",
               "test_runtime.py", "test_speculative.py", "test_quantize_cli.py", "test_block_min.py",
               "test_gemma3.py", "test_head_sizes.py", "test_pairing.py", "test_export_lazy.py")


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
