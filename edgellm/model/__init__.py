"""The PyTorch model: `ModelConfig`, its presets, and the one `Decoder`."""

from .config import PRESETS, SHAPES, ModelConfig
from .decoder import Decoder

__all__ = ["PRESETS", "SHAPES", "ModelConfig", "Decoder"]
