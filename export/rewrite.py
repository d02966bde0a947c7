"""Checks and one small rewrite on an exported graph (ModelProto without weight data, so cheap to walk)."""

from __future__ import annotations

from collections import Counter

import onnx

from edgellm.runtime.errors import need
from edgellm.runtime.manifest import TensorSpec

# TensorSpec dtype -> ONNX element type (float16 / int8: the cache of manifest kv_dtype)
ONNX_TYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "int64": onnx.TensorProto.INT64,
              "int32": onnx.TensorProto.INT32, "int8": onnx.TensorProto.INT8}


def rsqrt_to_div(graph: onnx.GraphProto) -> int:
    """Mul(a, Reciprocal(y)) -> Div(a, y) where the Reciprocal feeds only that Mul.

    The exporter writes torch.rsqrt as Sqrt + Reciprocal; onnxruntime fuses Pow-ReduceMean-Add-Sqrt-Div-Mul
    into one SimplifiedLayerNormalization kernel but not the Reciprocal form. Returns the rewrites made.
    """
    producer = {out: node for node in graph.node for out in node.output}
    uses = Counter(name for node in graph.node for name in node.input)
    outputs = {o.name for o in graph.output}
    dropped: set[str] = set()
    for node in graph.node:
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
            continue
        for j in (0, 1):
            recip = producer.get(node.input[j])
            if (recip is not None and recip.op_type == "Reciprocal" and uses[recip.output[0]] == 1
                    and recip.output[0] not in outputs):
                a, y = node.input[1 - j], recip.input[0]
                node.op_type = "Div"
                del node.input[:]
                node.input.extend([a, y])
                dropped.add(recip.output[0])
                break
    kept = [n for n in graph.node if not (n.op_type == "Reciprocal" and n.output[0] in dropped)]
    del graph.node[:]
    graph.node.extend(kept)
    return len(dropped)


def matmul_weights(model: onnx.ModelProto, where: str) -> list[str]:
    """Names of the 2-D initializers feeding MatMul as B (the quantizer's rewrite target).

    Fails if a weight reaches a MatMul/Gemm through a runtime Transpose: that would copy the weight on
    every call and hide it from the quantizer.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    found = []
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        b = node.input[1]
        src = producer.get(b)
        need(not (src is not None and src.op_type == "Transpose" and src.input[0] in inits),
             f"{where}: weight {src.input[0] if src else b} reaches {node.op_type} through a runtime Transpose")
        if b in inits and len(inits[b].dims) == 2:
            found.append(b)
    return found


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def check_io(model: onnx.ModelProto, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
             where: str) -> None:
    """The graph's inputs/outputs are exactly the specs, in order, with static shapes."""
    for side, got, want in (("inputs", model.graph.input, inputs), ("outputs", model.graph.output, outputs)):
        got_specs = []
        for v in got:
            t = v.type.tensor_type
            got_specs.append((v.name, tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim),
                              t.elem_type))
        want_specs = [(s.name, tuple(s.shape), ONNX_TYPES[s.dtype]) for s in want]
        need(got_specs == want_specs, f"{where}: graph {side} {got_specs} differ from the contract {want_specs}")
