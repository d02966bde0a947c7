"""Small edits of ONNX graphs shared by the quantization rewrites: loading one, names in use, dropping
initializers nothing reads, raising an opset import."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from edgellm.runtime.errors import EdgeError


def load_graph(path: Path, external: bool) -> onnx.ModelProto:
    """onnx.load with a corrupt file reported as one line naming it (protobuf's DecodeError otherwise escapes);
    `external`: with its external data, read relative to the graph's folder."""
    try:
        return onnx.load(str(path), load_external_data=external)
    except Exception as err:  # google.protobuf DecodeError, OSError, onnx's own errors
        raise EdgeError(f"{path}: not a readable ONNX graph ({' '.join(str(err).split())[:200]})") from None


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every name a node (subgraphs included: If / Loop / Scan bodies read outer names) or an output reads."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                used |= used_names(sub)
    return used


def prune_initializers(graph: onnx.GraphProto, among: set[str] | None = None) -> list[str]:
    """Drop the initializers (and their value_info) nothing reads, of `among` only when given; their names."""
    used = used_names(graph)
    dead = [t.name for t in graph.initializer if t.name not in used and (among is None or t.name in among)]
    dead_set = set(dead)
    for field_ in (graph.initializer, graph.value_info):   # delete in place: no copy of the other weights
        for i in reversed([i for i, t in enumerate(field_) if t.name in dead_set]):
            del field_[i]
    return dead


def require_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Raise (never lower) the opset import of `domain` ("" = the default, also spelled "ai.onnx") to
    `version`, adding it if missing."""
    for op in model.opset_import:
        if op.domain == domain or (domain == "" and op.domain == "ai.onnx"):
            op.version = max(op.version, version)
            return
    model.opset_import.append(helper.make_opsetid(domain, version))
