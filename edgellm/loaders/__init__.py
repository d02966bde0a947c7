"""Checkpoints -> `Decoder`: Hugging Face (safetensors), llama.cpp `.gguf`, llama2.c `.bin`, and edgellm's own format.

`load_checkpoint(path)` picks the loader from what is at `path`; `save_checkpoint` writes the native format
(also used by training, with optional optimizer state read back by `load_extra_state`).
"""

from .dispatch import load_checkpoint
from .loaded import Loaded
from .native import load_extra_state, save_checkpoint

__all__ = ["Loaded", "load_checkpoint", "load_extra_state", "save_checkpoint"]
