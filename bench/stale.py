"""Which cached benchmark exports are out of date: the bench scripts reuse exports under --root between runs,
and an export written by an older edgellm (an older manifest format) runs older graphs, so timing it would
report an old layout as today's. They are rebuilt instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from edgellm.runtime.manifest import FORMAT_VERSION


def fresh(out: Path) -> bool:
    """True if `out` holds an export in the manifest format edgellm writes now; a stale one is removed."""
    try:
        version = json.loads((out / "manifest.json").read_text())["format_version"]
    except (OSError, ValueError, KeyError):
        version = None
    if version == FORMAT_VERSION:
        return True
    if out.exists():
        print(f"{out}: manifest format {version}, edgellm writes {FORMAT_VERSION}: rebuilding")
        shutil.rmtree(out)
    return False
