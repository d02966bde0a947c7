"""Give freed memory back to the OS between export steps, so one step's peak is not the next one's floor.

Two things keep freed memory resident (measured on a Qwen2.5-0.5B-shaped export, 1.98 GB of fp32 weights):
- onnx_ir graphs are reference cycles, so a traced unit's tensors live until the cycle collector runs (a
  layer's 60 MB piled up for ~6 layers at a time);
- glibc keeps freed blocks below its mmap threshold (which grows to 32 MB after a large block is freed) in
  its heaps: 0.92 GB of [heap] stayed resident after the export had freed everything, and that floor sat
  under the runtime check that needs ~1x the weights.
`release_memory()` runs the collector and, on glibc, `malloc_trim(0)` (returns every free page to the OS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _trim():
    """glibc's malloc_trim, or None (musl, macOS, Windows: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_memory() -> None:
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
