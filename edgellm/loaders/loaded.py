"""What every loader returns: the model (eval mode, float32), its config, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgellm.model import Decoder, ModelConfig

if TYPE_CHECKING:
    from .lazy import LazyWeights


@dataclass
class Loaded:
    model: Decoder  # eval mode, float32, on the CPU (on the meta device when `weights` is set)
    config: ModelConfig
    tokenizer_path: Path | None  # tokenizer.json / tokenizer.bin found with (or, GGUF, rebuilt from) the checkpoint
    source: str  # "hf" | "gguf" | "llama2c" | "edgellm"
    weights: LazyWeights | None = None  # load_checkpoint(lazy=True): fills `model` part by part; close it
