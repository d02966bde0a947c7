"""Training state next to a native checkpoint: a nested dict split into tensors + JSON, never pickle.

`extra_state` (e.g. {"optimizer": opt.state_dict(), "step": 1200}) is a tree of dicts (str or int keys),
lists, tuples, str/int/float/bool/None and torch tensors. Tensors go to `extra_state.safetensors` under their
path ("optimizer/state/0/exp_avg"); the tree goes to `extra_state.json` with {"__tensor__": path} in their
place. Dicts with non-str keys and tuples are tagged so that the round trip returns the same Python types
(torch optimizers key their state by int and keep betas as tuples).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from edgellm.runtime.errors import EdgeError, need

from .tensors import TensorSource

FORMAT, VERSION = "edgellm-extra-state", 1
TREE_FILE, TENSOR_FILE = "extra_state.json", "extra_state.safetensors"


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        need(path not in tensors, f"extra_state: two tensors at {path} (a key containing '/'?)")
        tensors[path] = value.detach().to("cpu").contiguous()
        return {"__tensor__": path}
    if isinstance(value, dict):
        items = [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]
        if all(isinstance(k, str) and not k.startswith("__") for k, _ in items):
            return dict(items)
        for k, _ in items:
            need(isinstance(k, (str, int)) and not isinstance(k, bool), f"extra_state: key {k!r} at {path or '/'} "
                 f"is not a str or int")
        return {"__items__": items}
    if isinstance(value, (list, tuple)):
        encoded = [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
        return {"__tuple__": encoded} if isinstance(value, tuple) else encoded
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}  # JSON has no inf/nan
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise EdgeError(f"extra_state: {type(value).__name__} at {path or '/'} cannot be saved (expected dicts, lists, "
                    f"tuples, numbers, strings, None or tensors)")


def _decode(value: Any, source: TensorSource | None, where: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, source, where) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        name = value["__tensor__"]
        need(source is not None and name in source, f"{where}: tensor {name!r} is not in {TENSOR_FILE}")
        return source.get(name).clone()  # own the memory: the file's memory map closes after loading
    if "__items__" in value:
        return {k: _decode(v, source, where) for k, v in value["__items__"]}
    if "__tuple__" in value:
        return tuple(_decode(v, source, where) for v in value["__tuple__"])
    if "__float__" in value:
        return float(value["__float__"])
    return {k: _decode(v, source, where) for k, v in value.items()}


def write_extra_state(directory: Path, state: dict[str, Any]) -> None:
    """Write extra_state.json (+ extra_state.safetensors when there are tensors) into `directory`."""
    need(isinstance(state, dict), f"extra_state must be a dict, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    if tensors:
        save_file(tensors, str(directory / TENSOR_FILE), metadata={"format": FORMAT})
    doc = {"format": FORMAT, "format_version": VERSION, "tensors": TENSOR_FILE if tensors else None, "tree": tree}
    (directory / TREE_FILE).write_text(json.dumps(doc, indent=1), encoding="utf-8")


def read_extra_state(directory: Path) -> dict[str, Any]:
    path = directory / TREE_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EdgeError(f"{path}: not readable JSON ({exc})") from None
    need(isinstance(doc, dict) and doc.get("format") == FORMAT, f"{path}: not an {FORMAT} file")
    need(doc.get("format_version") == VERSION, f"{path}: format_version {doc.get('format_version')!r} is not "
         f"supported (this edgellm reads {VERSION})")
    if doc.get("tensors") is None:
        return _decode(doc["tree"], None, path)
    need(doc["tensors"] == TENSOR_FILE, f"{path}: tensors must be in {TENSOR_FILE}")
    with TensorSource([directory / TENSOR_FILE]) as source:
        return _decode(doc["tree"], source, path)
