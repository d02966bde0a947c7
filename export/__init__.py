"""Decoder -> ONNX graphs with a static KV cache + manifest.json, verified against PyTorch.

    options.py    ExportOptions: the `edgellm export` flags
    graphs.py     the units (embed, layers, head or the whole model) and their graphs' I/O
    trace.py, fused.py, rewrite.py   a unit -> ONNX: torch.onnx, then onnxruntime's fused kernels
    unit.py, datafile.py, verify.py  one unit's variants written, their shared data file, parity vs PyTorch
    e2e.py        end-to-end check through the runtime's cache rule; journal.py: resumable exports
    exporter.py   export_model: all of the above into an export directory
    tokenizer_files.py, bos_rule.py   the tokenizer, chat template, end ids and BOS rule an export ships

Pairing and stacking (shared with quant) live in edgellm.layout. Names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"export_model": "exporter", "ExportOptions": "options"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
