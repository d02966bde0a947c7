"""A graph built node by node (export/fused.py, fused_ring.py): generated value names, initializers, and which of
them are the model's weights (they go to the layer's data file)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper


class GraphBuilder:
    """Nodes and initializers of one graph; `weights` collects the state-dict tensors (for the data file)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.weights: set[str] = set()
        self._n = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}" + (f"_{j}" if n_out > 1 else "") for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}", domain=domain,
                                           **attrs))
        return outs

    def const(self, name: str, array: np.ndarray, weight: bool = False) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.ascontiguousarray(array), name))
        if weight:
            self.weights.add(name)
        return name


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A parameter or buffer as a float32 array."""
    return t.detach().to(torch.float32).numpy()
