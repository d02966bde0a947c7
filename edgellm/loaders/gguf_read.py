"""GGUF's header, metadata and tensor table, parsed in one pass over a memory map.

Why not `gguf.GGUFReader`: it keeps every part of every metadata value as its own numpy view of the map, and
building 4-5 of them per vocabulary entry costs 13 s for Gemma 3's 262,144-token table (2 s for SmolLM2's
49,152) before a single weight is read; this reader makes one Python object per entry (0.3 s for Gemma). The
`gguf` package still supplies the type tables (GGML_QUANT_SIZES) and the dequantizers.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64; each metadata
entry is a string key, a u32 value type and the value (strings: u64 length + UTF-8; arrays: u32 item type,
u64 count, items); each tensor: name, u32 n_dims, u64 ne[n_dims] (fastest-varying first), u32 ggml type, u64
offset; tensor data from the next multiple of `general.alignment` (32 unless given).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# value type -> (struct format, numpy dtype) for the fixed-size scalars; 8 = string, 9 = array
_SCALARS = {0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
            6: ("f", "<f4"), 7: ("?", "?"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8")}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]             # ne: fastest-varying dimension first (numpy's shape reversed)
    tensor_type: GGMLQuantizationType
    data_offset: int                   # absolute, in the file
    n_bytes: int
    data: np.ndarray                   # uint8 [rows, bytes per row], a view of the map (rows = prod(ne[1:]))


class Parser:
    """Cursor over the mapped bytes; a read past the end raises ValueError (the caller names the file)."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw, self.buf, self.pos = raw, memoryview(raw), 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if count > len(self.buf) - self.pos:  # every item takes a byte at least: a corrupt count
                raise ValueError(f"an array of {count} items runs past the end of the file")
            if item in _SCALARS:  # numbers: one numpy read, then Python scalars
                dtype = np.dtype(_SCALARS[item][1])
                values = np.frombuffer(self.raw, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind][0])


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata key -> Python value, tensor name -> TensorInfo) of a GGUF whose header `check_header` passed.
    ValueError / struct.error on a damaged file; the tensors' extents are checked against the file's size."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    p = Parser(mapped.view(np.ndarray))  # a plain view: slicing the np.memmap subclass is slow
    p.pos = 8  # magic and version (checked by the caller)
    n_tensors, n_fields = p.scalar("Q"), p.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = p.string()
        fields[key] = p.value(p.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = p.string()
        ne = tuple(p.scalar("Q") for _ in range(p.scalar("I")))
        infos.append((name, ne, GGMLQuantizationType(p.scalar("I")), p.scalar("Q")))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise ValueError(f"general.alignment is {align!r}")
    start = -(-p.pos // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, ne, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"duplicate tensor name {name}")
        block, size = GGML_QUANT_SIZES[kind]
        if ne and ne[0] % block:
            raise ValueError(f"tensor {name}: rows of {ne[0]} values do not fill {kind.name} blocks of {block}")
        row_bytes = ne[0] // block * size if ne else size
        rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        begin = start + offset
        end = begin + rows * row_bytes
        if end > len(p.raw):
            raise EOFError(f"tensor {name} ends at byte {end}, the file has {len(p.raw)}")
        data = p.raw[begin:end].reshape(rows, row_bytes)
        tensors[name] = TensorInfo(name, ne, kind, begin, rows * row_bytes, data)
    return fields, tensors
