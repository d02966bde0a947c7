"""`load_checkpoint(path)`: decide what is at `path` and hand it to the matching loader."""

from __future__ import annotations

from pathlib import Path

from edgellm.runtime.errors import EdgeError, need

from .gguf import is_gguf_file, load_gguf
from .hf import INDEX, SINGLE, is_hf_dir, load_hf
from .llama2c import load_llama2c
from .loaded import Loaded
from .native import MARKER, WEIGHTS, is_native_dir, load_native

EXPECTED = (f"a directory with {MARKER} + {WEIGHTS} (edgellm), a directory with config.json + {SINGLE} or "
            f"{INDEX} (Hugging Face), a .gguf file (llama.cpp), or a llama2.c .bin file")


def load_checkpoint(path: Path, lazy: bool = False) -> Loaded:
    """Load an edgellm, Hugging Face, GGUF or llama2.c checkpoint as an eval-mode float32 `Decoder`.

    `lazy`: for safetensors and GGUF checkpoints, everything is checked but the weights stay in the file
    until asked for (`Loaded.weights`, see lazy.py; close it when done); llama2.c files load whole.
    """
    path = Path(path)
    need(path.exists(), f"{path}: no such file or directory (expected {EXPECTED})")
    if is_native_dir(path):  # checked first: an explicit marker beats a stray config.json
        return load_native(path, lazy)
    if is_hf_dir(path):
        return load_hf(path, lazy)
    if is_gguf_file(path):  # by suffix or magic; load_gguf checks the magic
        return load_gguf(path, lazy)
    if path.is_file() and path.suffix == ".bin":
        return load_llama2c(path)
    raise EdgeError(f"{path}: not a checkpoint edgellm can load (expected {EXPECTED})")
