"""Module -> ONNX IR with the dynamo exporter, then initializers renamed after the state dict.

Why dynamo (`torch.onnx.export(dynamo=True, optimize=True)`) and not the TorchScript path: on a Qwen2-0.5B
shaped layer both decode in the same time under onnxruntime (2.6 ms, 1 thread, max_seq 512), but dynamo
writes IR 10 / opset 20 (TorchScript: IR 8), constant-folds the causal mask and every weight transpose
(72 nodes vs 169 with Shape/Trilu/Tile left in), and keeps parameter names for 1-D weights.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from collections import defaultdict

import numpy as np
import onnx_ir as ir
import torch
from torch import Tensor, nn

from edgellm.runtime.errors import EdgeError


def trace_graph(module: nn.Module, inputs: dict[str, Tensor], output_names: list[str], opset: int,
                where: str) -> ir.Model:
    """Export with static shapes (no dynamic axes): every size is fixed by `inputs`."""
    quiet = logging.getLogger("torch.onnx")  # "torchvision is not installed" and friends
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = _export(module, tuple(inputs.values()), list(inputs), output_names, opset)
    except Exception as err:  # the exporter raises many types; the user needs the graph and the first line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise EdgeError(f"{where}: torch.onnx.export failed: {first}") from err
    finally:
        quiet.setLevel(level)
    return program.model


def _export(module: nn.Module, args: tuple, input_names: list[str], output_names: list[str], opset: int):
    """`torch.onnx.export(dynamo=True, optimize=True)` with static shapes, minus its fixed cost.

    The public call rebuilds the aten->ONNX registry (parsing ~500 onnxscript functions, ~40% of a layer's
    export time) on every call; the internal call it makes (torch is pinned) gets a cached registry instead.
    """
    registry = _registry(opset)
    if registry is None:
        return torch.onnx.export(module, args, input_names=input_names, output_names=output_names,
                                 opset_version=opset, dynamo=True, optimize=True, verbose=False)
    from torch.onnx._internal.exporter import _core

    return _core.export(module, args, registry=registry, input_names=input_names, output_names=output_names,
                        optimize=True, verbose=False, opset_version=opset)


@functools.cache
def _registry(opset: int) -> object | None:
    try:
        from torch.onnx._internal.exporter import _core, _registration
    except ImportError:
        return None
    if not (hasattr(_core, "export") and hasattr(_registration.ONNXRegistry, "from_torchlib")):
        return None
    return _registration.ONNXRegistry.from_torchlib(opset_version=opset)


def fold_weight_transposes(model: ir.Model) -> int:
    """Transpose(initializer) -> a transposed initializer; returns the folds made.

    The exporter's optimizer folds W.T for a Linear, but not when the Transpose output has several users
    (the tied table's E^T feeding both the head MatMul and the embedding Gather in the "model" graph of
    exports before 2026-11-26; today the head reads E itself, Gemm transB=1).
    """
    graph, folded = model.graph, 0
    for node in list(graph):
        src = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if src is None or not src.is_initializer() or src.const_value is None or node.outputs[0].is_graph_output():
            continue
        perm = node.attributes.get("perm")
        array = np.transpose(src.const_value.numpy(), perm.as_ints() if perm is not None else None)
        value = ir.Value(name=f"{src.name}.T", shape=ir.Shape(array.shape), type=ir.TensorType(src.dtype),
                         const_value=ir.tensor(array))
        graph.register_initializer(value)
        node.outputs[0].replace_all_uses_with(value)
        graph.remove(node, safe=True)
        if not src.uses():
            graph.initializers.pop(src.name)
        folded += 1
    return folded


def strip_metadata(model: ir.Model) -> None:
    """Drop the exporter's per-node stack traces and FX dumps (most of a small graph's bytes, and paths of
    this machine); keep "namespace", the module path an op came from."""
    for node in model.graph:
        for key in [k for k in node.metadata_props if k != "namespace"]:
            del node.metadata_props[key]


def name_weights(model: ir.Model, weights: dict[str, Tensor]) -> set[str]:
    """Rename initializers whose content equals a state-dict tensor (or its transpose) to its name.

    The exporter names folded weights "val_8"; the quantizer and humans want "layers.3.attn.qkv.weight".
    A MatMul weight keeps the state-dict name although it is stored transposed, [in, out].
    Returns the names of the initializers that hold weights.
    """
    candidates: dict[tuple[int, ...], list[tuple[str, np.ndarray]]] = defaultdict(list)
    for name, tensor in weights.items():
        a = tensor.detach().numpy()
        candidates[a.shape].append((name, a))
        if a.ndim == 2:
            candidates[a.T.shape].append((name, a.T))
    taken = set(model.graph.initializers)
    found: set[str] = set()
    for value in list(model.graph.initializers.values()):
        if value.const_value is None:
            continue
        arr = value.const_value.numpy()
        for name, a in candidates.get(arr.shape, ()):
            if a.dtype == arr.dtype and _same(arr, a):
                if name != value.name and name not in taken:
                    taken.discard(value.name)
                    value.name = name
                    taken.add(name)
                found.add(value.name)
                break
    return found


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality, rejecting most mismatches on the first row before comparing everything."""
    if a.ndim and not np.array_equal(a[:1], b[:1]):
        return False
    return bool(np.array_equal(a, b))
