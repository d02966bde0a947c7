"""What every loader returns: the model (eval mode, float32), its config, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgellm.model import Decoder, ModelConfig


@dataclass
class Loaded:
    model: Decoder  # eval mode, float32, on the CPU
    config: ModelConfig
    tokenizer_path: Path | None  # tokenizer.json / tokenizer.bin found with (or, GGUF, rebuilt from) the checkpoint
    source: str  # "hf" | "gguf" | "llama2c" | "edgellm"
