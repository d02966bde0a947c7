"""One graph file for both variants of a layer (or of the stack): the variant graphs merged into one graph
whose sequence dim S is symbolic.

Why one graph: onnxruntime pre-packs a quantized weight per session, and Python cannot share packed weights
between sessions, so a prefill and a decode session per layer held two packed copies. Why not the `If` of
formats 3-4 (both variant graphs as branches, weights in the outer scope): onnxruntime keeps an outer-scope
weight's raw copy until every branch has packed it, so loading peaked far above the steady state, and it
loaded and decoded slower (docs/benchmarks.md, "History").

The variants run the same nodes: the exporters build both from one recipe, and only constants holding S
differ (shape targets of `Reshape`, the S of `total_len - S`). Merging requires exactly that — equal nodes
(ops, wiring, attributes), every other initializer byte-identical — and makes each S-constant S-free:
  - a `Reshape` target that differs in one position (1 vs prefill_chunk): -1 there;
  - the value S itself ([] or [1]): computed in the graph as Shape(first S input)[1], cast to its type.
Anything else is refused (an internal error): a merged graph must compute what each variant computes.
  inputs / outputs  the variants' names; dim 1 symbolic ("S") where the variants differ (tokens, hidden)
Manifest `graphs[].paired` (since format 5; the `If` graphs of formats 3-4 are no longer read).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgellm.runtime.errors import need


def _symbolic_seq(value: onnx.ValueInfoProto, other: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """A copy of `value` with dim 1 made symbolic ("S") if the other variant's differs (hidden states, tokens)."""
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    dims, others = out.type.tensor_type.shape.dim, other.type.tensor_type.shape.dim
    if len(dims) > 1 and dims[1].dim_value != others[1].dim_value:
        dims[1].ClearField("dim_value")
        dims[1].dim_param = "S"
    return out


def renamed_nodes(nodes: Iterable[onnx.NodeProto], names: dict[str, str], prefix: str) -> list[onnx.NodeProto]:
    """Copies of `nodes` with every input/output in `names` renamed and `prefix` before each node name (for
    placing one graph's nodes beside another's: a stack unit in stacking.py)."""
    out = []
    for n in nodes:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.input[:] = [names.get(i, i) for i in n.input]
        m.output[:] = [names.get(o, o) for o in n.output]
        m.name = prefix + (n.name or n.output[0])
        out.append(m)
    return out


def _s_free(name: str, decode: np.ndarray, prefill: np.ndarray, chunk: int, graph: onnx.GraphProto,
            seq_input: str) -> tuple[onnx.TensorProto | None, list[onnx.NodeProto]]:
    """The S-free replacement of a constant that holds 1 in the decode graph where the prefill graph holds
    `chunk`: a new initializer, or nodes computing it (output `name`) from `seq_input`'s dim 1."""
    where = f"internal: cannot merge the variants' constant {name!r} ({decode.tolist()} vs {prefill.tolist()})"
    need(decode.shape == prefill.shape and decode.dtype == prefill.dtype and decode.dtype.kind == "i", where)
    at = np.flatnonzero(decode.ravel() != prefill.ravel())
    need(bool(np.all(decode.ravel()[at] == 1) and np.all(prefill.ravel()[at] == chunk)), where)
    users = [(n.op_type, i) for n in graph.node for i, x in enumerate(n.input) if x == name]
    if users and all(u == ("Reshape", 1) for u in users) and len(at) == 1 and -1 not in decode:
        target = decode.copy()
        target.ravel()[at[0]] = -1  # Reshape infers the one -1 dim: S in either variant
        return numpy_helper.from_array(target, name), []
    need(decode.size == 1 and decode.ndim <= 1, where)
    s = f"{name}/S"
    nodes = [helper.make_node("Shape", [seq_input], [s + "64"], name=s + "/Shape", start=1, end=2)]  # int64 [1]
    if decode.ndim == 0:
        nodes.append(helper.make_node("Squeeze", [s + "64"], [s + "64s"], name=s + "/Squeeze"))
    cast_to = helper.np_dtype_to_tensor_dtype(decode.dtype)
    nodes.append(helper.make_node("Cast", [nodes[-1].output[0]], [name], name=s + "/Cast", to=cast_to))
    return None, nodes


def pair_layer(prefill: onnx.ModelProto, decode: onnx.ModelProto) -> onnx.ModelProto:
    """The one graph of a layer (or of the stack, stacking.py) that runs both variants, from its two variant
    graphs as written (fp32 or quantized; weights already in their data files)."""
    p, d = prefill.graph, decode.graph
    need([i.name for i in d.input] == [i.name for i in p.input] and
         [o.name for o in d.output] == [o.name for o in p.output],
         "internal: a graph's prefill and decode variants must have the same input/output names")
    need(len(d.node) == len(p.node) and all(a.SerializeToString() == b.SerializeToString()
                                            for a, b in zip(d.node, p.node, strict=True)),
         f"internal: {d.name}: the prefill and decode variants run different nodes, they cannot be merged")
    inputs = [_symbolic_seq(a, b) for a, b in zip(d.input, p.input, strict=True)]
    outputs = [_symbolic_seq(a, b) for a, b in zip(d.output, p.output, strict=True)]
    seq_inputs = [v.name for v in inputs if len(v.type.tensor_type.shape.dim) > 1
                  and v.type.tensor_type.shape.dim[1].dim_param == "S"]
    need(len(seq_inputs) > 0, f"internal: {d.name}: the variants' inputs do not differ in S")
    chunk = next(v for v in p.input if v.name == seq_inputs[0]).type.tensor_type.shape.dim[1].dim_value
    p_init = {t.name: t for t in p.initializer}
    need(sorted(p_init) == sorted(t.name for t in d.initializer),
         f"internal: {d.name}: the variants have different initializers")
    inits, computed = [], []
    for t in d.initializer:
        if t.SerializeToString() == p_init[t.name].SerializeToString():
            inits.append(t)
            continue
        need(t.data_location != onnx.TensorProto.EXTERNAL,
             f"internal: {d.name}: the variants' weight {t.name!r} differs")
        new, nodes = _s_free(t.name, numpy_helper.to_array(t), numpy_helper.to_array(p_init[t.name]), chunk, d,
                             seq_inputs[0])
        inits += [new] if new is not None else []
        computed += nodes
    # no value_info: the decode graph's would pin intermediate shapes to S = 1
    graph = helper.make_graph(computed + list(d.node), d.name, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=list(decode.opset_import), ir_version=decode.ir_version,
                             producer_name=decode.producer_name, producer_version=decode.producer_version)
