"""Read a MatMulNBits node's weight back from a graph (tests, reports): B, scales (following the Cast from a
float16 initializer that `fp16_scales` writes), zero points and the shape attributes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgellm.runtime.errors import need

from .packing import NBitsArrays


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray:
    """An initializer, or the float32 Cast of one (the fp16-scales form)."""
    inits = {t.name: t for t in graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    cast = next((n for n in graph.node if n.op_type == "Cast" and list(n.output) == [name]), None)
    need(cast is not None and cast.input[0] in inits, f"MatMulNBits input {name}: not an initializer or its Cast")
    return numpy_helper.to_array(inits[cast.input[0]]).astype(np.float32)


def read_nbits(graph: onnx.GraphProto, node: onnx.NodeProto) -> NBitsArrays:
    """The node's weight arrays (external data must be loaded)."""
    need(node.op_type == "MatMulNBits", f"{node.name}: expected a MatMulNBits node, got {node.op_type}")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    zp = _constant(graph, node.input[3]) if len(node.input) > 3 and node.input[3] else None
    return NBitsArrays(_constant(graph, node.input[1]), _constant(graph, node.input[2]), zp, attrs["bits"],
                       attrs["block_size"], attrs["K"], attrs["N"])
