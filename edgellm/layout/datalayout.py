"""Where tensors go in an external data file, for export (export/datafile.py) and quantize (quant/storage.py)
alike: the one alignment rule and the one content key, so both write files the runtime maps the same way.

Tensors of PAGED bytes or more start on a page: onnxruntime (and the runtime's shared maps) map them instead of
copying them. Smaller ones (norms, scales: copied anyway) start on SMALL_ALIGN bytes and are written after the
paged ones: a page of padding in front of every big tensor that followed a scale tensor was 0.3 MB of
SmolLM2-135M's int8 export. Tensors are keyed by the sha256 of their bytes, so a tensor is stored once.
"""

from __future__ import annotations

import hashlib

ALIGN = 4096      # page size
PAGED = 1 << 16   # tensors of this many bytes or more start on a page
SMALL_ALIGN = 64


def aligned(end: int, length: int) -> int:
    """Where a tensor of `length` bytes starts in a file of `end` bytes."""
    step = ALIGN if length >= PAGED else SMALL_ALIGN
    return -(-end // step) * step


def paged_first(length: int) -> bool:
    """Sort key: the paged tensors before the small ones."""
    return length < PAGED


def content_key(data: bytes | memoryview) -> str:
    """The key a tensor's bytes are stored under."""
    return hashlib.sha256(data).hexdigest()
