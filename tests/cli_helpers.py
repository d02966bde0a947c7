"""Shared by the CLI reliability tests (test_reliability_cli.py, test_reliability_exports.py): the tiny
checkpoint they break, the one-line-error check, and ways to break a file (the exports come from
tests/runtime_fixtures.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from edgellm.cli import main
from edgellm.loaders import save_checkpoint
from tests.export_helpers import tiny_model


def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny native checkpoint (no tokenizer)."""
    path = tmp_path_factory.mktemp("rel-cli") / "ckpt"
    save_checkpoint(tiny_model("llama2", seed=0, n_layers=1), path)
    return path


def fails(capsys, argv: list[str], *needles: object) -> str:
    """Run the CLI in-process; it must exit 2 with one `edgellm VERB: error: ...` line holding `needles`."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.startswith(f"edgellm {argv[0]}: error: "), err
    assert "Traceback" not in err and out == "", (out, err)
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err


def copy_with(src: Path, dst: Path, edit: Callable[[Path], None]) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def reseal(directory: Path, rel: str) -> None:
    """Record a changed file's new sha256 and size in manifest.json, so only a deeper check can catch it."""
    doc = json.loads((directory / "manifest.json").read_text())
    data = (directory / rel).read_bytes()
    doc["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (directory / "manifest.json").write_text(json.dumps(doc))


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def truncate(rel: str, keep: float) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = (d / rel).read_bytes()
        (d / rel).write_bytes(data[: int(len(data) * keep)])
    return edit


def flip(rel: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = bytearray((d / rel).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (d / rel).write_bytes(bytes(data))
    return edit


def truncate_resealed(rel: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        truncate(rel, 0.5)(d)
        reseal(d, rel)
    return edit
