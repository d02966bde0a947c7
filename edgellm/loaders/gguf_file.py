"""Reading a GGUF file (llama.cpp's single-file format): header checks, typed metadata, and `GGUFSource`,
the tensors by name with the duck-typed API of `tensors.TensorSource` (names, __contains__, file,
shape_dtype, get), so `check_plan` / `fill_model` fill a meta-built `Decoder` from it as from safetensors.

`gguf_read.read_gguf` memory-maps the file and parses only the metadata and tensor table; `get` dequantizes one
tensor at a time (gguf.quants.dequantize) to float32, so filling a model costs the float32 model plus the
largest tensor plus the file's pages touched so far (a quantized file is 1/8-1/2 of the float32 model).
GGUF shapes (`ne`) list the fastest-varying dimension first: the numpy/torch shape is `ne` reversed.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgellm.runtime.errors import EdgeError, need

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp reads; v1 files predate the 64-bit counts

# ggml tensor types edgellm dequantizes (to float32); the float ones are exact
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

Transform = Callable[[np.ndarray], np.ndarray]  # applied to a dequantized tensor (numpy shape) by `get`


def has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def check_header(path: Path) -> int:
    """The GGUF version, after checking the magic and that the version is one edgellm reads."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise EdgeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    need(len(head) == 8, f"{path}: truncated GGUF file ({len(head)} bytes, no header)")
    need(head[:4] == MAGIC, f"{path}: not a GGUF file (magic {head[:4]!r}, expected {MAGIC!r})")
    version = struct.unpack("<I", head[4:])[0]
    need(version & 0xFFFF != 0 or struct.unpack(">I", head[4:])[0] not in VERSIONS,
         f"{path}: a big-endian GGUF file (edgellm reads little-endian ones, as llama.cpp writes them)")
    need(version in VERSIONS, f"{path}: GGUF version {version} is not supported (expected one of "
         f"{', '.join(map(str, VERSIONS))})")
    return version


class GGUFFile:
    """The parsed header, metadata and tensor table of one GGUF file; use as a context manager."""

    def __init__(self, path: Path) -> None:
        try:
            from .gguf_read import read_gguf  # the gguf package (type tables, dequantizers): host-side only
        except ImportError:
            raise EdgeError(f"{path}: reading GGUF files needs the gguf package (pip install 'edgellm[host]')") from None

        self.path = Path(path)
        self.version = check_header(self.path)
        try:
            self.fields, self.tensors = read_gguf(self.path)
        except EOFError as exc:
            raise EdgeError(f"{self.path}: truncated GGUF file ({exc})") from None
        except Exception as exc:  # ValueError, struct.error, UnicodeDecodeError, ... on a damaged file
            raise EdgeError(f"{self.path}: corrupt or truncated GGUF file ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None

    # ---- metadata ----
    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python data (str, int, float, bool, or a list of them)."""
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        need(key in self.fields, f"{self.path}: missing metadata key {key}")
        return self.get(key)

    def integer(self, key: str, default: int | None = None, positive: bool = True) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        ok = isinstance(value, int) and not isinstance(value, bool) and (value > 0 or not positive)
        need(ok, f"{self.path}: metadata {key} must be a {'positive ' if positive else ''}integer, got {value!r:.40}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.require(key) if default is None else self.get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
        need(ok, f"{self.path}: metadata {key} must be a number, got {value!r:.40}")
        return float(value)

    def forget(self, prefix: str) -> None:
        """Drop the parsed metadata under `prefix` (a vocabulary's strings: ~30 MB for Gemma 3's 262k tokens),
        which need not sit beside the model being filled."""
        for key in [k for k in self.fields if k.startswith(prefix)]:
            del self.fields[key]

    # ---- tensors ----
    def numpy_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def type_histogram(self) -> Counter[str]:
        return Counter(t.tensor_type.name for t in self.tensors.values())

    def close(self) -> None:
        self.tensors.clear()  # drops the views, and with the last one the memory map
        self.fields.clear()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GGUFSource:
    """GGUF tensors as a `TensorSource`: float32 on `get`, with per-tensor `transforms` (llama Q/K order)."""

    def __init__(self, file: GGUFFile, transforms: dict[str, Transform] | None = None) -> None:
        self.gguf = file
        self.transforms = transforms or {}

    def names(self) -> set[str]:
        return set(self.gguf.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.gguf.tensors

    def file(self, name: str) -> Path:
        return self.gguf.path

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """Shape (numpy order) and "F32": what `get` delivers; an unsupported ggml type is an EdgeError."""
        kind = self.gguf.type_name(name)
        need(kind in SUPPORTED_TYPES, f"{self.gguf.path}: tensor {name} has ggml type {kind}, which edgellm "
             f"cannot dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        return self.gguf.numpy_shape(name), "F32"

    def get(self, name: str) -> torch.Tensor:
        """The tensor as float32, dequantized into its final buffer a block of rows at a time (gguf-py's
        dequantize holds ~2 copies of whatever it is given; chunks keep that small next to a 100 MB embedding)."""
        from gguf.quants import dequantize

        tensor = self.gguf.tensors[name]
        shape = self.shape_dtype(name)[0]
        data = tensor.data
        out = np.empty(shape, dtype=np.float32)
        flat = out.reshape(-1, shape[-1]) if len(shape) > 1 else out.reshape(1, -1)
        rows = data.reshape(flat.shape[0], -1)
        step = max(1, _CHUNK // max(1, flat.shape[1]))
        try:
            for r in range(0, flat.shape[0], step):
                flat[r:r + step] = dequantize(rows[r:r + step], tensor.tensor_type).reshape(-1, flat.shape[1])
        except Exception as exc:
            raise EdgeError(f"{self.gguf.path}: cannot dequantize tensor {name} ({type(exc).__name__}: {exc})") from None
        if name in self.transforms:
            out = np.ascontiguousarray(self.transforms[name](out))
        return torch.from_numpy(out)

    def close(self) -> None:
        """Drop the file's memory map (a lazy load's LazyWeights closes its source when export is done)."""
        self.gguf.close()


_CHUNK = 1 << 22  # values per dequantize call (16 MB of float32)
