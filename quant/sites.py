"""Which initializers of a graph are weights a plan may quantize, and the torch module each belongs to."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgellm.runtime.errors import need

from .plan import WeightSite


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def weight_use(node: onnx.NodeProto, inits: Mapping[str, TensorProto]) -> tuple[str, str] | None:
    """(initializer, layout) if `node` reads a constant 2-D float32 weight we can rewrite; layout is
    "kn" (MatMul B), "nk" (Gemm transB=1 B) or "rows" (Gather table)."""
    if node.domain not in ("", "ai.onnx"):
        return None
    a = _attrs(node)
    if node.op_type == "MatMul":
        name, layout = node.input[1], "kn"
    elif node.op_type == "Gemm":
        has_c = len(node.input) > 2 and node.input[2] != ""
        if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or (has_c and a.get("beta", 1.0) != 1.0):
            return None
        name, layout = node.input[1], ("nk" if a.get("transB", 0) else "kn")
    elif node.op_type == "Gather" and a.get("axis", 0) == 0:
        name, layout = node.input[0], "rows"
    else:
        return None
    t = inits.get(name)
    if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
        return None
    need(t.data_location != TensorProto.EXTERNAL,
         f"initializer {name} still lives in external data: load the model with load_external_data=True")
    return name, layout


def module_of(node: onnx.NodeProto, init_name: str) -> str:
    """Module path from torch.onnx's `pkg.torch.onnx.name_scopes` metadata, else from a `*.weight` name."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            if isinstance(scopes, list) and len(scopes) >= 2:
                return str(scopes[-2])
    return init_name[: -len(".weight")] if init_name.endswith(".weight") else ""


def matmul_weights(graph: onnx.GraphProto) -> Iterator[tuple[WeightSite, np.ndarray]]:
    """Each distinct matmul weight (MatMul B, Gemm B) of a graph with its data loaded, as (site, w [N, K])."""
    inputs = {v.name for v in graph.input}
    inits = {t.name: t for t in graph.initializer if t.name not in inputs}
    seen: set[str] = set()
    for node in graph.node:
        hit = weight_use(node, inits)
        if hit is None or hit[1] == "rows" or hit[0] in seen:
            continue
        name, layout = hit
        seen.add(name)
        w = numpy_helper.to_array(inits[name])
        w = np.ascontiguousarray(w.T if layout == "kn" else w)
        yield WeightSite(name, node.op_type, node.name, module_of(node, name), w.shape), w
