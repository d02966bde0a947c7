"""External data: each unit's weights written once into `<stem>.data`, shared by both graph variants.

Tensors are keyed by content (sha256 of their bytes), so the prefill and decode graphs of a unit - traced
separately, holding separate copies - point at the same offsets, and a tensor already in another file is
referenced there instead of written again: a tied embedding table in head.data, the RoPE tables every fused
layer reads in rope.data (written once before the layers; export/unit.py). Tensors of 64 KB or more start
on a page so onnxruntime maps the weights instead of reading them; with prepacking off
("session.disable_prepacking") both sessions of a unit share those pages (six Qwen2-0.5B layer sessions:
+12 MB RSS, vs +370 MB of packed copies by default). Tensors under 64 KB (norms, scales) start on 64 bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from edgellm.layout.datalayout import aligned, content_key, paged_first

THRESHOLD = 1 << 16  # graph constants (shapes, masks) below this stay inside the .onnx file; weights never


@dataclass(frozen=True)
class Ref:
    file: str    # relative to the export directory
    offset: int
    length: int


class DataFile:
    """Appends tensors to `directory/name`; `known` maps content keys to tensors in other files."""

    def __init__(self, directory: Path, name: str, known: dict[str, Ref] | None = None) -> None:
        self.directory, self.name = Path(directory), name
        self.known = dict(known or {})
        self.index: dict[str, Ref] = {}  # content key -> where this file holds it
        self.used: set[str] = set()      # every data file the graphs written so far point into
        self._file = open(self.directory / name, "wb")
        self._end = 0

    def put(self, array: np.ndarray) -> Ref:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        key = content_key(data)
        ref = self.index.get(key) or self.known.get(key)
        if ref is None:
            start = aligned(self._end, len(data))
            self._file.write(b"\0" * (start - self._end))
            self._file.write(data)
            self._end = start + len(data)
            ref = self.index[key] = Ref(self.name, start, len(data))
        self.used.add(ref.file)
        return ref

    def externalize(self, model: ir.Model, weights: set[str]) -> None:
        """Move the initializers named in `weights`, any other of THRESHOLD bytes or more, and any that `known`
        holds (a shared table costs nothing to point at) into data files (the model keeps references): a data
        file holds the state dict, not shape constants."""
        values = list(model.graph.initializers.values())  # the paged ones first: small ones pack after them
        for value in sorted(values, key=lambda v: v.const_value is None or paged_first(v.const_value.nbytes)):
            tensor = value.const_value
            if tensor is None:
                continue
            array = tensor.numpy()
            if value.name not in weights and tensor.nbytes < THRESHOLD and not (self.known and _key(array) in self.known):
                continue
            ref = self.put(array)
            value.const_value = ir.ExternalTensor(ref.file, ref.offset, ref.length, tensor.dtype,
                                                  shape=ir.Shape(list(tensor.shape)), name=value.name,
                                                  base_dir=str(self.directory))

    def close(self) -> None:
        """Flush to disk; an unused (empty) file is deleted."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._end == 0:
            (self.directory / self.name).unlink()



def _key(array: np.ndarray) -> str:
    """The content key `put` files a tensor under."""
    return content_key(memoryview(np.ascontiguousarray(array)).cast("B"))
