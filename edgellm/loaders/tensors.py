"""Reading named tensors out of safetensors files (never pickle), and copying them into a `Decoder`.

`TensorSource` indexes one file or a sharded set (HF `model.safetensors.index.json`) by tensor name from the
headers (`safe_open`); `get` reads one tensor through a short-lived mapping, so filling a model costs ~1x its
float32 weights plus the largest single tensor (measured: 1.05x above the torch baseline for a 0.5B bf16
checkpoint). Any safetensors failure (truncated file, corrupt header, bad offsets) becomes an `EdgeError`
naming the file.

`check_plan` + `fill_model` are how weights enter a model: a plan maps every state-dict name to the source
tensors concatenated (along dim 0) into it; names, shapes and dtypes are checked (headers only) before the
model is even allocated (`meta_decoder` -> `materialize`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import safe_join

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors dtype tags we convert to float32

Plan = dict[str, tuple[str, ...]]  # state-dict name -> source tensor names, concatenated along dim 0


class TensorSource:
    """name -> tensor over safetensors files; use as a context manager (closes the memory maps)."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self.transposed: Callable[[str], bool] = lambda name: False  # 2-D tensors stored [in, out] (GPT-2 Conv1D)
        # added to a tensor as it is read (float32): Gemma's RMSNorm gains are stored as w for (1 + w)
        self.offset: Callable[[str], float] = lambda name: 0.0
        try:
            for path in files:
                handle = self._open(Path(path))
                for name in _call(path, handle.keys):
                    need(name not in self._where, f"{path}: tensor {name} also in {self._where.get(name)}")
                    self._where[name] = Path(path)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_index(cls, index: Path) -> TensorSource:
        """The shards listed by an HF `*.safetensors.index.json`; checks the index matches the shards."""
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EdgeError(f"{index}: not a safetensors index (expected JSON with a weight_map): {exc}") from None
        need(isinstance(weight_map, dict) and weight_map, f"{index}: weight_map is empty or not an object")
        shards = {name: safe_join(index.parent, rel) for name, rel in weight_map.items()}
        for shard in sorted(set(shards.values())):
            need(shard.is_file(), f"{index}: lists {shard.name}, which does not exist")
        source = cls(sorted(set(shards.values())))
        for name, shard in shards.items():
            if source._where.get(name) != shard:
                source.close()
                raise EdgeError(f"{index}: says {name} is in {shard.name}, but it is not there")
        return source

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                open(path, "rb").close()  # safetensors reports a permission error as "No such file or directory"
            except OSError as exc:
                raise EdgeError(f"{path}: cannot read ({exc.strerror or exc})") from None
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # SafetensorError, OSError: both mean "not a usable file"
                raise EdgeError(f"{path}: not a readable safetensors file ({exc})") from None
            self._handles[path] = handle
        return handle

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file(self, name: str) -> Path:
        return self._where[name]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """Shape and safetensors dtype tag ("F32", "BF16", ...) without reading the data."""
        path = self._where[name]
        piece = _call(path, self._handles[path].get_slice, name)
        shape = tuple(piece.get_shape())
        if len(shape) == 2 and self.transposed(name):
            shape = shape[::-1]
        return shape, piece.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read through a short-lived mapping: unmapping it right away drops the file's pages
        from this process's resident memory, so they do not pile up on top of the model being filled."""
        path = self._where[name]
        try:
            with safe_open(str(path), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except Exception as exc:
            raise EdgeError(f"{path}: corrupt safetensors file ({exc})") from None
        offset = self.offset(name)
        if offset:  # in float32, as transformers computes (1.0 + weight.float()) per call
            tensor = tensor.float() + offset
        return tensor.t() if tensor.dim() == 2 and self.transposed(name) else tensor

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _call(path: Path, fn, *args):
    """Run a safetensors call, turning its errors into an EdgeError that names the file."""
    try:
        return fn(*args)
    except Exception as exc:
        raise EdgeError(f"{path}: corrupt safetensors file ({exc})") from None


def check_plan(shapes: dict[str, tuple[int, ...]], plan: Plan, source: TensorSource, where: str,
               ignored: Iterable[str] = ()) -> None:
    """Every model tensor (name -> shape) planned; every source present, float, and shaped to fit its share
    of the target; no source tensor left unused unless `ignored`. Reads headers only."""
    unplanned = sorted(set(shapes) - set(plan))
    need(not unplanned, f"{where}: nothing to load into {', '.join(unplanned[:5])}")
    used: set[str] = set()
    for target, names in plan.items():
        want = shapes[target]
        rows = 0
        for name in names:
            need(name in source, f"{where}: missing tensor {name} (needed for {target} {list(want)})")
            shape, dtype = source.shape_dtype(name)
            need(dtype in FLOAT_DTYPES, f"{source.file(name)}: tensor {name} has dtype {dtype}; expected a float "
                 f"type ({', '.join(sorted(FLOAT_DTYPES))}); quantized checkpoints are not supported")
            need(len(shape) == len(want) and shape[1:] == want[1:],
                 f"{source.file(name)}: tensor {name} has shape {list(shape)}; expected {_pattern(want, len(names))}")
            rows += shape[0]
            used.add(name)
        need(rows == want[0], f"{where}: {' + '.join(names)} {'give' if len(names) > 1 else 'has'} {rows} rows for "
             f"{target}; expected {want[0]} (config and weights disagree)")
    unexpected = sorted(source.names() - used - set(ignored))
    need(not unexpected, f"{where}: unexpected tensors {', '.join(unexpected[:5])}"
         f"{' ...' if len(unexpected) > 5 else ''} (a feature this loader does not support?)")


def _pattern(shape: tuple[int, ...], parts: int) -> str:
    """The shape a source must have: exact, or [*, rest] when several sources are concatenated."""
    if parts == 1:
        return str(list(shape))
    return "[" + ", ".join(["*", *map(str, shape[1:])]) + "]"


def fill_model(model: Decoder, plan: Plan, source: TensorSource) -> None:
    """Copy the planned tensors into the model's parameters (float32), one source tensor at a time."""
    state = model.state_dict()  # detached views sharing storage with the parameters
    with torch.no_grad():
        for target, names in plan.items():
            row = 0
            for name in names:
                tensor = source.get(name)
                state[target][row:row + tensor.shape[0]].copy_(tensor)
                row += tensor.shape[0]
                del tensor  # keep at most one source tensor alive


def meta_decoder(cfg: ModelConfig) -> Decoder:
    """The model `cfg` builds, on the meta device: names and shapes, no memory."""
    with torch.device("meta"):
        return Decoder(cfg)


def shapes(model: Decoder) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


_REBUILT = {"rotary.inv_freq", "rotary.xpos_base", "rotary_local.inv_freq", "rotary_local.xpos_base"}  # non-persistent buffers; set_context_len rebuilds inv_freq


def materialize(meta: Decoder) -> Decoder:
    """Real memory for a meta-device model whose parameters the caller then overwrites, every one of them.

    Skips the random init (about 20 s for a 0.5B model on two cores). The RoPE inverse frequencies are the
    only computed buffer and set_context_len rebuilds them; a model with XPos, or with any buffer this does
    not know how to rebuild, is built the ordinary way instead.
    """
    transient = {name for name, _ in meta.named_buffers()} - set(meta.state_dict())
    if meta.cfg.xpos or transient - _REBUILT:
        return Decoder(meta.cfg)
    model = meta.to_empty(device="cpu")
    model.set_context_len(model.cfg.max_seq_len)
    return model
