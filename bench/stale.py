"""Cached benchmark exports are rebuilt when out of date: the bench scripts reuse exports under --root between
runs, and an export written by an older edgellm (an older manifest format) runs older graphs, so timing it
would report an old layout as today's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from edgellm.quant.options import QuantizeOptions
from edgellm.runtime.manifest import FORMAT_VERSION, READS


def rebuild_if_stale(out: Path, build: Callable[[], object], source_rebuilt: bool = False) -> bool:
    """Run `build` (which writes `out`) unless `out` already holds an export in the manifest format edgellm
    writes now, quantized (if it is) with today's set of `quantize` options (a new option changes what a
    default run writes, e.g. --scales-dtype), and the export it derives from was not just rebuilt. True if it
    built."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError):
        manifest, version = {}, None
    current = isinstance(version, int) and FORMAT_VERSION <= version <= max(READS)  # 15: quantize's int8 cache
    recorded = set((manifest.get("quantization") or {}).get("options", {}))
    options = not recorded or recorded == {f.name for f in fields(QuantizeOptions)}
    if current and options and not source_rebuilt:
        return False
    if out.exists():
        why = ("derived from an export just rebuilt" if current and options
               else "quantized before today's quantize options" if current
               else f"manifest format {version}, edgellm writes {FORMAT_VERSION}")
        print(f"{out}: {why}: rebuilding")
        shutil.rmtree(out)
    build()
    return True
