"""Cached benchmark exports are rebuilt when out of date: the bench scripts reuse exports under --root between
runs, and an export written by an older edgellm (an older manifest format) runs older graphs, so timing it
would report an old layout as today's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from edgellm.quant.kv_cache import auto_fp16
from edgellm.quant.options import QuantizeOptions
from edgellm.runtime.manifest import FORMAT_VERSION, READS


def resolved_options(flags: list[str]) -> dict:
    """The options `edgellm quantize FLAGS` runs with today (its profile's defaults filled in), as the manifest
    records them; without `kept_grids`, which quantize finds in the weights."""
    from edgellm.cli import build_parser
    from edgellm.cli.quantize import options_from_args

    options = options_from_args(build_parser().parse_args(["quantize", "x", "-o", "y", *flags])).to_dict()
    return json.loads(json.dumps({k: v for k, v in options.items() if k != "kept_grids"}))


def rebuild_if_stale(out: Path, build: Callable[[], object], source_rebuilt: bool = False,
                     quantize_flags: list[str] | None = None) -> bool:
    """Run `build` (which writes `out`) unless `out` already holds an export in the manifest format edgellm
    writes now, quantized (if it is) with today's set of `quantize` options (a new option changes what a
    default run writes, e.g. --scales-dtype) — and, given the `quantize_flags` it is built with, today's values
    of them (a profile's changed default, e.g. small's int8 head rows), with the cache `--kv-dtype auto` gives its
    max_seq today — and the export it derives from was not just rebuilt. True if it built."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError):
        manifest, version = {}, None
    current = isinstance(version, int) and FORMAT_VERSION <= version <= max(READS)  # 15: quantize's int8 cache
    recorded = set((manifest.get("quantization") or {}).get("options", {}))
    options = not recorded or recorded == {f.name for f in fields(QuantizeOptions)}
    kept = (manifest.get("quantization") or {}).get("options", {})
    if options and recorded and quantize_flags is not None:
        options = all(kept.get(k) == v for k, v in resolved_options(quantize_flags).items())
    if kept.get("kv_dtype") == "auto" and manifest.get("kv_dtype") == "float16":
        options = options and auto_fp16(manifest.get("max_seq", 0))  # auto's rule since 2026-11-28
    if current and options and not source_rebuilt:
        return False
    if out.exists():
        why = ("derived from an export just rebuilt" if current and options
               else "quantized with other options than today's quantize gives its flags" if current
               else f"manifest format {version}, edgellm writes {FORMAT_VERSION}")
        print(f"{out}: {why}: rebuilding")
        shutil.rmtree(out)
    build()
    return True
