"""The file helpers every writer uses (runtime/fileio.py): streamed sha256, atomic file and directory outputs
that leave nothing half-written and never replace what they did not write."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import atomic_dir, atomic_write_bytes, sha256_file
from edgellm.runtime.manifest import MANIFEST


def test_sha256_file_streams_large_files(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)  # spans several 1 MiB chunks
    (tmp_path / "big").write_bytes(data)
    assert sha256_file(tmp_path / "big") == hashlib.sha256(data).hexdigest()


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    atomic_write_bytes(path, b"one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_dir_leaves_nothing_on_exception(tmp_path: Path) -> None:
    final = tmp_path / "export"
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(final) as tmp:
        (tmp / "half.data").write_bytes(b"x")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with atomic_dir(final) as tmp:  # an old complete output ...
        (tmp / MANIFEST).write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_dir(final, marker=MANIFEST) as tmp:
        (tmp / MANIFEST).write_text("new")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["export"] and (final / MANIFEST).read_text() == "old"  # ... survives


def test_atomic_dir_replaces_an_old_complete_output(tmp_path: Path) -> None:
    final = tmp_path / "export"
    final.mkdir()
    (final / MANIFEST).write_text("old")
    (final / "stale.data").write_text("old weights")
    with atomic_dir(final, marker=MANIFEST) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".export.tmp-") and not final.joinpath("x").exists()
        (tmp / MANIFEST).write_text("new")
    assert os.listdir(tmp_path) == ["export"]
    assert os.listdir(final) == [MANIFEST] and (final / MANIFEST).read_text() == "new"


def test_atomic_dir_refuses_to_replace_what_it_did_not_write(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(EdgeError, match="has no manifest.json, refusing to replace it"), \
            atomic_dir(home, marker=MANIFEST):
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(EdgeError, match="exists and is not a directory"), atomic_dir(tmp_path / "file"):
        pass
    assert (home / "thesis.tex").read_text() == "precious" and sorted(os.listdir(tmp_path)) == ["file", "home"]
    with pytest.raises(EdgeError, match="file/out: cannot create the output directory"), \
            atomic_dir(tmp_path / "file" / "out"):
        pass
    with pytest.raises(EdgeError, match="file/x: cannot write"):
        atomic_write_bytes(tmp_path / "file" / "x", b"")
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty, marker=MANIFEST) as tmp:  # an empty directory holds nothing to lose
        (tmp / MANIFEST).write_text("new")
    assert os.listdir(empty) == [MANIFEST]
