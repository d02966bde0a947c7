"""The resume journal of a partial export: which units are written and verified, and their checksums.

`<out>.partial/journal.json` (format "edgellm-export-journal", version 1) is rewritten atomically after each
unit. A unit counts as done only if every file it lists still has its recorded sha256, so a truncated,
corrupted or deleted file makes that unit (and only it) export again. The journal is bound to an identity
hash of the options, config, weights and tool versions: any change starts a clean directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import torch

from edgellm import __version__
from edgellm.model import ModelConfig
from edgellm.runtime.errors import need
from edgellm.runtime.fileio import atomic_write_text, sha256_file

from .datafile import Ref
from .options import ExportOptions

JOURNAL = "journal.json"
FORMAT = "edgellm-export-journal"
VERSION = 1


@dataclass
class UnitRecord:
    files: dict[str, str]               # relpath -> sha256: the unit's own files and any data file it uses
    data: str | None                    # the one external-data file its graphs point into
    tensors: dict[str, list]            # content key -> [file, offset, length] of what it wrote
    verification: dict[str, float]      # graph name -> max abs diff
    ops: dict[str, dict[str, int]]      # graph name -> op counts
    matmul_weights: dict[str, int]      # graph name -> MatMul/Gemm weights fed straight from initializers

    def refs(self) -> dict[str, Ref]:
        return {key: Ref(*where) for key, where in self.tensors.items()}


def export_identity(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], options: ExportOptions) -> str:
    """sha256 over everything that determines the exported bytes; `tensors`: the state dict in name order
    (one at a time from a lazily loaded checkpoint)."""
    digest = hashlib.sha256()
    meta = {"journal": VERSION, "edgellm": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "options": options.to_dict(), "config": cfg.to_dict()}
    digest.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name, tensor in tensors:
        t = tensor.detach().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(memoryview(t.numpy()).cast("B"))
    return digest.hexdigest()


class Journal:
    def __init__(self, directory: Path, identity: str, units: dict[str, UnitRecord]) -> None:
        self.directory, self.identity, self.units = directory, identity, units

    @classmethod
    def open(cls, directory: Path, identity: str, log: Callable[[str], None]) -> Journal:
        """Resume `directory` if its journal has this identity; otherwise empty it and start clean."""
        path = directory / JOURNAL
        need(not directory.exists() or path.is_file() or (directory.is_dir() and not any(directory.iterdir())),
             f"{directory}: exists but holds no {JOURNAL}, so it is not an edgellm partial export; remove it")
        units, why = _read(path, identity) if path.is_file() else (None, "")
        if units is None and path.is_file():
            log(f"{directory}: {why}; starting clean")
            shutil.rmtree(directory)
        elif units is not None:
            log(f"{directory}: resuming an interrupted export ({len(units)} unit(s) recorded)")
        directory.mkdir(parents=True, exist_ok=True)
        journal = cls(directory, identity, units or {})
        journal._save()
        return journal

    def reusable(self, stem: str) -> tuple[UnitRecord | None, str]:
        """The record of `stem` if all its files still match their checksums, else (None, why)."""
        rec = self.units.get(stem)
        if rec is None:
            return None, "not exported yet"
        for rel, sha in rec.files.items():
            path = self.directory / rel
            if not path.is_file():
                return None, f"{rel} is missing"
            if sha256_file(path) != sha:
                return None, f"{rel} does not match its checksum"
        return rec, "checksums match"

    def record(self, stem: str, rec: UnitRecord) -> None:
        self.units[stem] = rec
        self._save()

    def forget(self, stem: str) -> None:
        if self.units.pop(stem, None) is not None:
            self._save()

    def _save(self) -> None:
        doc = {"format": FORMAT, "version": VERSION, "identity": self.identity,
               "units": {k: asdict(v) for k, v in self.units.items()}}
        atomic_write_text(self.directory / JOURNAL, json.dumps(doc, indent=1) + "\n")


def _read(path: Path, identity: str) -> tuple[dict[str, UnitRecord] | None, str]:
    """(recorded units, "") or (None, why they cannot be reused)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            return None, f"{JOURNAL} is format {doc.get('format')!r} version {doc.get('version')!r}, " \
                         f"not {FORMAT!r} version {VERSION}"
        if doc.get("identity") != identity:
            return None, "left by an export with other options, weights or edgellm/torch version"
        return {k: UnitRecord(**v) for k, v in doc["units"].items()}, ""
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        return None, f"{JOURNAL} is unreadable ({type(err).__name__})"
