"""Cached benchmark exports are rebuilt when out of date: the bench scripts reuse exports under --root between
runs, and an export written by an older edgellm (an older manifest format) runs older graphs, so timing it
would report an old layout as today's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from edgellm.runtime.manifest import FORMAT_VERSION, READS


def rebuild_if_stale(out: Path, build: Callable[[], object], source_rebuilt: bool = False) -> bool:
    """Run `build` (which writes `out`) unless `out` already holds an export in the manifest format edgellm
    writes now and the export it derives from was not just rebuilt. True if it built."""
    try:
        version = json.loads((out / "manifest.json").read_text())["format_version"]
    except (OSError, ValueError, KeyError):
        version = None
    current = isinstance(version, int) and FORMAT_VERSION <= version <= max(READS)  # 15: quantize's int8 cache
    if current and not source_rebuilt:
        return False
    if out.exists():
        why = ("derived from an export just rebuilt" if current
               else f"manifest format {version}, edgellm writes {FORMAT_VERSION}")
        print(f"{out}: {why}: rebuilding")
        shutil.rmtree(out)
    build()
    return True
