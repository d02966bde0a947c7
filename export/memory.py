"""Give freed memory back to the OS between export steps, so one step's peak is not the next one's floor.

Two things keep freed memory resident (measured on a Qwen2.5-0.5B-shaped export, 1.98 GB of fp32 weights):
- onnx_ir graphs are reference cycles, so a traced unit's tensors live until the cycle collector runs (a
  layer's 60 MB piled up for ~6 layers at a time);
- glibc keeps freed blocks below its mmap threshold (which grows to 32 MB after a large block is freed) in
  its heaps: 0.92 GB of [heap] stayed resident after the export had freed everything, and that floor sat
  under the runtime check that needs ~1x the weights.
`release_memory(nbytes)` runs the collector and, on glibc, `malloc_trim(0)` (returns every free page to the OS),
for models of at least RELEASE_MIN_BYTES of weights. Below that nothing a step leaves behind matters, while a full
collection costs 0.1-0.3 s in a process holding torch, onnx and transformers (seven per export: a third of a
two-layer model's export time).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import torch


@functools.cache
def _trim():
    """glibc's malloc_trim, or None (musl, macOS, Windows: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


RELEASE_MIN_BYTES = 64 << 20


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters (meta tensors count what they will hold: a lazy load's model)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def release_memory(nbytes: int) -> None:
    """Collect and trim after a step of an export whose weights take `nbytes` (nothing below RELEASE_MIN_BYTES)."""
    if nbytes < RELEASE_MIN_BYTES:
        return
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
