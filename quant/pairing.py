"""One graph file per layer for both variants: the prefill and decode graphs as the branches of an `If`.

onnxruntime pre-packs a quantized weight per session, and Python cannot share packed weights between
sessions, so a prefill and a decode session per layer held two packed copies. In one session the branches
share the outer graph's initializers and their packed form: int4 Qwen2.5-0.5B shape, peak RSS 1001 -> 819
MB, stories110M int8 339 -> 270 MB; decode per layer within 1-2 % (the selector fed as an input: deriving
it in-graph from Shape(hidden) cost 5 %).

The paired graph (manifest format 3, `GraphSpec.paired`):
  inputs   hidden [1, S, D] (S symbolic), seqlens_k, total_len, past_key.i, past_value.i, decode (bool [])
  outputs  hidden_out [1, S, D], present_key.i, present_value.i (the whole cache, written in place)
  nodes    If(decode) then: the S = 1 graph, else: the S = prefill_chunk graph
Initializers both variants hold identically (every weight: they share one data file and offsets) move to
the outer graph; any that differ (shape constants holding S) stay inside their branch. The runtime feeds
`decode` per variant (graphio.selector_feeds) and binds both variants' present_* to the same cache buffers,
which onnxruntime's If passes through to GroupQueryAttention: the cache is still written in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper

from edgellm.runtime.errors import need
from edgellm.runtime.graphio import SELECTOR


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
    placing one graph's nodes beside another's: an If branch here, a stack unit in stacking.py)."""
    out = []
    for n in nodes:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.input[:] = [names.get(i, i) for i in n.input]
        m.output[:] = [names.get(o, o) for o in n.output]
        m.name = prefix + (n.name or n.output[0])
        out.append(m)
    return out


def _branch(graph: onnx.GraphProto, prefix: str, shared: set[str]) -> onnx.GraphProto:
    """`graph` as an If branch: no inputs (it reads the outer scope), every value it makes renamed with
    `prefix` (so neither branch shadows an outer name), its own initializers minus the shared ones."""
    local = {o: prefix + o for n in graph.node for o in n.output if o}
    nodes = renamed_nodes(graph.node, local, prefix)
    outputs = []
    for o in graph.output:
        need(o.name in local, f"internal: graph output {o.name!r} is not computed by a node")
        v = onnx.ValueInfoProto()
        v.CopyFrom(o)
        v.name = local[o.name]
        outputs.append(v)
    inits = [t for t in graph.initializer if t.name not in shared]
    return helper.make_graph(nodes, prefix.rstrip("/"), [], outputs, inits)


def pair_layer(prefill: onnx.ModelProto, decode: onnx.ModelProto) -> onnx.ModelProto:
    """The paired graph of one layer (or of the stack, stacking.py) from its two (already quantized, data
    placed) variants."""
    names = [i.name for i in decode.graph.input]
    need(names == [i.name for i in prefill.graph.input] and
         [o.name for o in decode.graph.output] == [o.name for o in prefill.graph.output],
         "internal: a graph's prefill and decode variants must have the same input/output names")
    p_init = {t.name: t for t in prefill.graph.initializer}
    shared = {t.name for t in decode.graph.initializer
              if t.name in p_init and t.SerializeToString() == p_init[t.name].SerializeToString()}
    inputs = [*(_symbolic_seq(d, p) for d, p in zip(decode.graph.input, prefill.graph.input, strict=True)),
              helper.make_tensor_value_info(SELECTOR.name, onnx.TensorProto.BOOL, [])]
    outputs = [_symbolic_seq(d, p) for d, p in zip(decode.graph.output, prefill.graph.output, strict=True)]
    branch = helper.make_node("If", [SELECTOR.name], [o.name for o in outputs], name="variant",
                              then_branch=_branch(decode.graph, "decode/", shared),
                              else_branch=_branch(prefill.graph, "prefill/", shared))
    graph = helper.make_graph([branch], decode.graph.name, inputs, outputs,
                              [t for t in decode.graph.initializer if t.name in shared])
    return helper.make_model(graph, opset_imports=list(decode.opset_import), ir_version=decode.ir_version,
                             producer_name=decode.producer_name, producer_version=decode.producer_version)
