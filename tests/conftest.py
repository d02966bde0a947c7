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
