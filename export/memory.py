"""Give freed memory back to the OS between export steps, so one step's peak is not the next one's floor.

Two things keep freed memory resident (measured on a Qwen2.5-0.5B-shaped export, 1.98 GB of fp32 weights):
- onnx_ir graphs are reference cycles, so a traced unit's tensors live until the cycle collector runs (a
  layer's 60 MB piled up for ~6 layers at a time);
- glibc keeps freed blocks below its mmap threshold (which grows to 32 MB after a large block is freed) in
  its heaps: 0.92 GB of [heap] stayed resident after the export had freed everything, and that floor sat
  under the runtime check that needs ~1x the weights.
`release_memory(n_params)` runs the collector and, on glibc, `malloc_trim(0)` (returns every free page to the OS),
for models of at least RELEASE_MIN_PARAMS parameters (64 MB of float32 weights). Below that nothing a step leaves behind matters, while a full
collection costs 0.1-0.3 s in a process holding torch, onnx and transformers (seven per export: a third of a
two-layer model's export time).
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


RELEASE_MIN_PARAMS = 16 << 20  # 64 MB of float32 (export takes float32 weights only)


def release_memory(n_params: int) -> None:
    """Collect and trim after a step of exporting a model of `n_params` (`ModelConfig.n_params()`; nothing below
    RELEASE_MIN_PARAMS)."""
    if n_params < RELEASE_MIN_PARAMS:
        return
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
