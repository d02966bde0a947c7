"""The additions a rewrite makes to a graph (quant/rewrite.py): new initializers, small shared constants, prologue
nodes fed only by initializers, and the activations' block means, each with a graph-unique name."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgellm.runtime.errors import need

from .packing import pack_nibbles


class Builder:
    """Collects new initializers / nodes with graph-unique names."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.taken = {t.name for t in graph.initializer} | {v.name for v in graph.input}
        self.taken |= {o for n in graph.node for o in n.output}
        self.inits: list[TensorProto] = []
        self.prologue: list[onnx.NodeProto] = []    # nodes fed only by initializers (DequantizeLinear)
        self.sums: dict[tuple[str, int, int], str] = {}  # (activation, K, block) -> its block means
        self.consts: dict[str, str] = {}                 # small constants shared by the nodes: base -> name

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}.{i}", i + 1
        self.taken.add(name)
        return name

    def array(self, base: str, value: np.ndarray) -> tuple[str, int]:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name, value.nbytes

    def const(self, base: str, value: np.ndarray) -> str:
        """A small constant initializer, one per `base` in the graph."""
        if base not in self.consts:
            self.consts[base] = self.array(base, value)[0]
        return self.consts[base]

    def cast_fp16(self, base: str, value: np.ndarray) -> str:
        """`value` stored float16 and a prologue Cast to float32 (folded when the session is created)."""
        half = self.array(f"{base}16", value.astype(np.float16))[0]
        out = self.fresh(base)
        self.prologue.append(helper.make_node("Cast", [half], [out], name=out, to=TensorProto.FLOAT))
        return out

    def block_means(self, x: str, k: int, block: int, nodes: list[onnx.NodeProto]) -> str:
        """The means of x [1, S, K] over each block of K, [1, S, nb]: one AveragePool (kernel = stride = block) per
        activation, appended to `nodes` the first time, so it precedes every reader. Not Reshape + ReduceSum:
        onnxruntime's ReduceSum keeps index tables per input shape in every node (SmolLM2-135M int4, 120 nodes:
        +49 MB RSS after a 64-row prefill, +17 with AveragePool), and is a node more."""
        key = (x, k, block)
        if key not in self.sums:
            need(k % block == 0, f"block offsets need K ({k}) a multiple of the block ({block})")
            out = self.sums[key] = self.fresh(f"{x}/block_means")
            nodes.append(helper.make_node("AveragePool", [x], [out], name=out, kernel_shape=[block], strides=[block]))
        return self.sums[key]

    def int4(self, base: str, values: np.ndarray, signed: bool) -> tuple[str, int]:
        """A 4-bit ONNX initializer: row-major values packed two per byte, low nibble first."""
        name = self.fresh(base)
        packed = pack_nibbles(values.reshape(-1)).tobytes()
        dtype = TensorProto.INT4 if signed else TensorProto.UINT4
        self.inits.append(helper.make_tensor(name, dtype, list(values.shape), packed, raw=True))
        return name, len(packed)
