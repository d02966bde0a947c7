"""Tiny exports and a quiet quantize for the quantize tests (test_quantize_cli, test_quantize_layout)."""

from __future__ import annotations

from pathlib import Path

from edgellm.export import ExportOptions, export_model
from edgellm.model import Decoder
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from tests.export_helpers import tiny_model

OPTIONS = dict(max_seq=48, prefill_chunk=8)


def export(tmp: Path, preset: str, granularity: str) -> tuple[Decoder, Path]:
    """A seeded tiny `preset` model and its export (in-place layers for granularity "layer")."""
    model = tiny_model(preset, seed=3)
    out = tmp / f"{preset}-{granularity}"
    export_model(model, out, ExportOptions(granularity=granularity, **OPTIONS), progress=False, log=lambda _: None)
    return model, out


def quantize(src: Path, out: Path, **kw) -> Path:
    """`edgellm quantize` without the fp32 check, progress or log (QuantizeOptions fields as keywords)."""
    quantize_export(src, out, QuantizeOptions(**kw), check=False, progress=False, log=lambda _: None)
    return out


def mapped_kb(name: str) -> int:
    """Resident kB of this process's mappings of files called `name` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header: range perms ... path
            ours = head[-1].endswith("/" + name)
        elif ours and head[0] == "Rss:":
            total += int(head[1])
    return total
