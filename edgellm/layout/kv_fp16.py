"""An fp16 KV cache in a fused layer graph: GroupQueryAttention's float inputs cast to fp16 in front of it, its
output cast back to fp32, the graph's past_* / present_* typed fp16; the rest of the layer stays fp32. The one
rewrite `edgellm export --kv-dtype float16` (export/fused.py) and `edgellm quantize` (quant/kv_cache.py) apply.

Why Casts: onnxruntime's CPU GroupQueryAttention takes one type for all its float inputs; its `T_CACHE` fp16 cache
with fp32 q/k/v ran 2x slower (docs/benchmarks.md). The RoPE tables' Casts fold when the session is created. The
Casts go after the spare row's Pad (layout/lone.py bypasses the Pad and keeps the Cast).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

CACHE_NAMES = ("past_key.", "past_value.", "present_key.", "present_value.")
CAST_INPUTS = (0, 1, 2, 7, 8)  # GroupQueryAttention's query (packed q/k/v), key, value, cos_cache, sin_cache


def fp16_cache(model: onnx.ModelProto) -> int:
    """Give every GroupQueryAttention of `model` an fp16 cache (in place): Casts to fp16 on its float inputs, its
    output cast back to fp32 under the output's name, past_* / present_* typed fp16. Returns the nodes changed."""
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        for i in CAST_INPUTS:
            if i < len(node.input) and node.input[i]:
                half = f"{base}/{i}/fp16"
                nodes.append(helper.make_node("Cast", [node.input[i]], [half], name=half, to=TensorProto.FLOAT16))
                node.input[i] = half
        out = node.output[0]
        node.output[0] = f"{base}/out/fp16"
        nodes.append(node)
        nodes.append(helper.make_node("Cast", [node.output[0]], [out], name=f"{base}/out/fp32",
                                      to=TensorProto.FLOAT))
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    for value in (*graph.input, *graph.output):
        if value.name.startswith(CACHE_NAMES):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return changed
