"""edgellm.runtime: the board side — numpy, onnxruntime and tokenizers only, never torch or onnx.

`Generator` (and its event/result types) load onnxruntime, so they are imported on first use: the
host-side packages import `edgellm.runtime.errors` without paying for onnxruntime.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Generator", "Result", "TokenEvent", "SessionConfig"]


def __getattr__(name: str) -> Any:
    if name in ("Generator", "Result", "TokenEvent"):
        from . import generator

        return getattr(generator, name)
    if name == "SessionConfig":
        from .session import SessionConfig

        return SessionConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
