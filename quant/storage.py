"""External data of a quantized export: every tensor written once, keyed by content.

The layout rule of design.md holds: the prefill and decode variants of a graph point into ONE data file,
`<stem>.data`. Their quantized initializers are byte-identical (the plan quantizes each weight once and
packs it deterministically), so the decode variant finds every tensor already in the file. A unit whose
big tensors all live in one earlier unit's file points there instead (the tied embedding reading the
lm_head's int8 table in head.data); if only some do, it gets its own file with copies, since a graph
names one data file. Tensors of 64 KB or more start on a page so onnxruntime (and the runtime's shared
maps) can mmap them; smaller ones on 64 bytes. Files the source's graphs read besides their own (`data`):
rope.data, the RoPE tables every fused layer reads, copied as it is and still the one place they live
(`copy_shared`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import onnx
from onnx import TensorProto

from edgellm.layout.datalayout import aligned, content_key, paged_first
from edgellm.runtime.errors import need
from edgellm.runtime.fileio import safe_join
from edgellm.runtime.manifest import GraphSpec
from edgellm.runtime.onnxmeta import read_graph_info

THRESHOLD = 1024  # smaller tensors (shape constants, scalars, small zero points) stay inside the .onnx


@dataclass(frozen=True)
class Ref:
    file: str
    offset: int
    length: int


def _big(t: TensorProto) -> bool:
    return t.HasField("raw_data") and len(t.raw_data) >= THRESHOLD


def copy_shared(src: Path, graphs: Iterable[GraphSpec], out: Path) -> dict[str, Ref]:
    """Copy the data files `graphs` (of the export `src`) read besides their own `data` into `out`, unchanged;
    returns content key -> Ref of every tensor read there."""
    spans: dict[str, set[tuple[int, int]]] = {}  # file -> (offset, length) of the tensors read in it
    for g in graphs:
        for t in read_graph_info(safe_join(src, g.file)).external:
            rel = str(PurePosixPath(g.file).parent / t.location)
            if rel != g.data:
                need(t.length >= 0, f"{src / g.file}: {t.name!r} in {rel} has no length")
                spans.setdefault(rel, set()).add((t.offset, t.length))
    refs = {}
    for rel, found in sorted(spans.items()):
        shutil.copyfile(safe_join(src, rel), out / rel)
        with open(out / rel, "rb") as f:
            for offset, length in sorted(found):
                f.seek(offset)
                data = f.read(length)
                need(len(data) == length, f"{src / rel}: ends before the tensor at {offset} (+{length} bytes)")
                refs[content_key(data)] = Ref(rel, offset, length)
    return refs


class DataStore:
    """The data files of one output directory; `place` moves a graph's big initializers into them, pointing at
    `shared` (copy_shared) for the tensors held there, whatever their size."""

    def __init__(self, directory: Path, shared: dict[str, Ref] | None = None) -> None:
        self.directory = Path(directory)
        self.shared = dict(shared or {})
        self.where: dict[str, dict[str, Ref]] = {}     # file -> content key -> Ref
        self._ends: dict[str, int] = {}
        self._handles: dict[str, BinaryIO] = {}

    def _write(self, file: str, data: bytes) -> Ref:
        if file not in self._handles:
            self._handles[file] = open(self.directory / file, "wb")  # closed in `close`
            self._ends[file] = 0
        end = self._ends[file]
        start = aligned(end, len(data))
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
        """Externalize `model`'s big initializers into `own`, or into an earlier file that already holds most
        of their bytes (a tied table's codes, written with the head: the embedding's lookup then reads that
        file, its own small tensors such as a split table's positions added there), so that each graph reads one
        data file and no tensor is stored twice; returns the data file its graph points into (None when every
        tensor is small)."""
        keyed = [(t, content_key(t.raw_data)) for t in model.graph.initializer
                 if t.HasField("raw_data")]
        for t, key in keyed:
            if key in self.shared:
                _refer(t, self.shared[key])
        tensors = [(t, key) for t, key in keyed if _big(t) and key not in self.shared]
        if not tensors:
            return None
        total = sum(len(t.raw_data) for t, _ in tensors)
        held = {f: sum(len(t.raw_data) for t, k in tensors if k in index) for f, index in self.where.items()}
        borrowed = [f for f, n in held.items() if 2 * n > total and f != own]
        target = own if held.get(own) or not borrowed else borrowed[0]
        index = self.where.setdefault(target, {})
        for t, key in sorted(tensors, key=lambda tk: paged_first(len(tk[0].raw_data))):  # (datalayout.py)
            ref = index.get(key)
            if ref is None:
                ref = index[key] = self._write(target, t.raw_data)
            _refer(t, ref)
        return target

    @property
    def files(self) -> list[str]:
        return sorted(self._ends)


def _refer(t: TensorProto, ref: Ref) -> None:
    """Make `t` an external tensor at `ref` (its bytes are there)."""
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    for k, v in (("location", ref.file), ("offset", str(ref.offset)), ("length", str(ref.length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
