"""Which KV cache a quantized export gets (`quantize --kv-dtype`), and its manifest (`with_cache`).

- float16: the fused layers' GroupQueryAttention reads and writes an fp16 cache, half the fp32 cache's bytes,
  through the Casts `edgellm export --kv-dtype float16` writes (one rewrite for both, edgellm/layout/kv_fp16.py):
  q / k / v and the RoPE tables cast to fp16 in front of the kernel (the tables' Casts fold when the session is
  created), its output cast back to fp32. Quality: SmolLM2-135M-Instruct KL to the fp32 export int8 0.0055 ->
  0.0056, int4 0.2262 -> 0.2226 (within noise). The fp32 export itself keeps an fp32 cache: it is the exact one,
  checked against PyTorch to --atol.
- `auto` (`edgellm quantize`'s default): float16 where the export can hold it and its max_seq is at least
  FP16_MIN_SEQ, else the export's (fp32) cache. Why by max_seq: onnxruntime's CPU GroupQueryAttention computes on
  an fp16 cache 1.2-3.8x slower than on an fp32 one at any context (one node, x86 AVX2, 64-1500 rows, shapes
  14/2, 9/3, 12/12 and 32/8 heads of 64: `python bench/gqa_cache.py`, 2026-11-28), and only the halved
  reads of a long cache pay that back: end to end fp32 is 14-17 % faster at 64 tokens of context (SmolLM2 int4,
  the lone-row stack), 5-12 % at the Qwen2.5-0.5B shape at 64-180, while fp16 wins +4 % at 800 and +21 % at 1800
  (SmolLM2 int4, 2026-11-27). The crossover lies near 700 rows, so fp16 pays once most of a filled cache's steps
  lie past it: max_seq >= 2 x 768. Below that the fp32 cache also costs more resident memory (SmolLM2 at 512:
  +15 MB), which is the price of the faster steps.
- int8: calibrated static scales (kv_int8.py), a flag.
- None: the export's cache as it is; "float32" too, checking that it is one (`--kv-dtype float32`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from edgellm.layout.kv_fp16 import CACHE_NAMES
from edgellm.runtime.errors import need
from edgellm.runtime.graphio import TensorSpec
from edgellm.runtime.manifest import KV_DTYPE_SINCE, KV_INT8_SINCE, Manifest

from .options import QuantizeOptions

FP16_MIN_SEQ = 1536  # `--kv-dtype auto` narrows the cache to fp16 from this max_seq on (docstring)


def auto_fp16(max_seq: int) -> bool:
    """Whether `--kv-dtype auto` gives an export of this max_seq an fp16 cache (where it can hold one)."""
    return max_seq >= FP16_MIN_SEQ


def refuse_reason(manifest: Manifest) -> str | None:
    """Why this export's cache cannot be made another type, or None."""
    if manifest.kv_layout != "inplace" or manifest.granularity != "layer":
        return "the cache is written by the fused layers only (export with --attention fused --granularity layer)"
    if manifest.kv_dtype != "float32":
        return f"the export's cache is {manifest.kv_dtype}; quantize an export made with --kv-dtype float32"
    if any(r != manifest.dims.layer_rows(0) for r in manifest.dims.all_rows):
        return "sliding-window layers (their ring caches attend in standard ops) keep float32 caches"
    return None


def cache_type(src: Path, manifest: Manifest, options: QuantizeOptions) -> str | None:
    """The cache type to write, or None (the export's): `--kv-dtype float16 / int8` (refused, naming why, where the
    export cannot hold it), `auto` float16 where it can and max_seq >= FP16_MIN_SEQ, else the export's."""
    if options.kv_dtype == manifest.kv_dtype:
        return None  # already that type (an fp16 export asked for float16)
    if options.kv_dtype == "float32":
        need(manifest.kv_dtype == "float32", f"--kv-dtype float32: {src}: the export's cache is {manifest.kv_dtype} "
                                             "(quantize keeps or narrows a cache; export with --kv-dtype float32)")
        return None
    reason = refuse_reason(manifest)
    if options.kv_dtype is None or (options.kv_dtype == "auto" and (reason is not None
                                                                   or not auto_fp16(manifest.max_seq))):
        return None
    need(reason is None, f"--kv-dtype {options.kv_dtype}: {src}: {reason}")
    return "float16" if options.kv_dtype == "auto" else options.kv_dtype


def with_cache(manifest: Manifest, dtype: str) -> Manifest:
    """The manifest with its cache tensors (past_* / present_* of every graph) of another type."""
    def typed(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        return tuple(dataclasses.replace(t, dtype=dtype) if t.name.startswith(CACHE_NAMES) else t for t in tensors)
    graphs = tuple(dataclasses.replace(g, inputs=typed(g.inputs), outputs=typed(g.outputs)) for g in manifest.graphs)
    version = max(KV_INT8_SINCE if dtype == "int8" else KV_DTYPE_SINCE, manifest.format_version)
    return dataclasses.replace(manifest, kv_dtype=dtype, graphs=graphs, format_version=version)
