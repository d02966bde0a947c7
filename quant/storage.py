"""External data of a quantized export: every tensor written once, page-aligned, keyed by content.

The layout rule of design.md holds: the prefill and decode variants of a graph point into ONE data file,
`<stem>.data`. Their quantized initializers are byte-identical (the plan quantizes each weight once and
packs it deterministically), so the decode variant finds every tensor already in the file. A unit whose
big tensors all live in one earlier unit's file points there instead (the tied embedding reading the
lm_head's int8 table in head.data); if only some do, it gets its own file with copies, since a graph
names one data file. Offsets are page-aligned so onnxruntime (and the runtime's shared maps) can mmap.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import TensorProto

from edgellm.runtime.errors import need

ALIGN = 4096      # as export/datafile.py: page-aligned tensors can be mapped instead of copied
THRESHOLD = 1024  # smaller tensors (shape constants, scalars, small zero points) stay inside the .onnx


@dataclass(frozen=True)
class Ref:
    file: str
    offset: int
    length: int


def _big(t: TensorProto) -> bool:
    return t.HasField("raw_data") and len(t.raw_data) >= THRESHOLD


class DataStore:
    """The data files of one output directory; `place` moves a graph's big initializers into them."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.where: dict[str, dict[str, Ref]] = {}     # file -> content key -> Ref
        self._ends: dict[str, int] = {}
        self._handles: dict[str, BinaryIO] = {}

    def _write(self, file: str, data: bytes) -> Ref:
        if file not in self._handles:
            self._handles[file] = open(self.directory / file, "wb")  # closed in `close`
            self._ends[file] = 0
        end = self._ends[file]
        start = -(-end // ALIGN) * ALIGN
        self._handles[file].write(b"\0" * (start - end))
        self._handles[file].write(data)
        self._ends[file] = start + len(data)
        return Ref(file, start, len(data))

    def close(self) -> None:
        """Flush and fsync every data file (the output directory is renamed into place after this)."""
        for f in self._handles.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._handles.clear()

    def place(self, model: onnx.ModelProto, own: str) -> str | None:
        """Externalize `model`'s big initializers into `own` (or an earlier file holding all of them);
        returns the data file its graph points into (None when every tensor is small)."""
        tensors = [t for t in model.graph.initializer if _big(t)]
        if not tensors:
            return None
        keys = [hashlib.sha256(t.raw_data).hexdigest() for t in tensors]
        holders = [f for f, index in self.where.items() if all(k in index for k in keys)]
        target = own if own in holders or not holders else holders[0]
        index = self.where.setdefault(target, {})
        for t, key in zip(tensors, keys, strict=True):
            ref = index.get(key)
            if ref is None:
                need(target == own, f"{own}: internal error, a tensor missing from borrowed {target}")
                ref = index[key] = self._write(own, t.raw_data)
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", ref.file), ("offset", str(ref.offset)), ("length", str(ref.length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
        return target

    @property
    def files(self) -> list[str]:
        return sorted(self._ends)
