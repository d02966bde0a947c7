"""The lone-row stack (manifest format 13, role "stack_lone"): the stack graph without its spare attention row.

Since format 10 every fused layer runs GroupQueryAttention on its S rows plus a zero row (export/fused.py):
onnxruntime's kernel computes a lone row in another summation order than the same row among two or more, so
without that row a decode step would not be bit for bit the row a speculative verification computes, and greedy
speculation could pick other tokens than plain decoding. The row costs a decode step 8-27 % (bench/spare_row.py:
stories110M int4 at 100 / 200 tokens of context 1.08-1.12x / 1.20-1.26x, SmolLM2-135M int4 at 100 / 400
1.11x / 1.27x): the kernel's many-row path packs K and V per head, its lone-row path reads them in place.

Only greedy decoding needs that equality. Sampling keeps its distribution through rejection sampling whatever
the rows' last bits, so a sampled run (`SessionConfig.exact = False`, the CLI's default for temperature > 0)
opens this graph instead: the same nodes, the same weights (it reads the stack's data files), with each layer's
Pad before GroupQueryAttention, the two `+ 1` on its lengths and the Slice after it bypassed. Its S >= 2 rows
are the stack's bit for bit (the kernel computes any two or more rows alike), which export and quantize check
on a prefill chunk; its decode step differs by the kernel's summation order only (recorded, loosely bounded).
"""

from __future__ import annotations

import onnx

from edgellm.runtime.errors import need

# the spare row's constants as export/fused.py names them (a layer's prefix before each; the stack keeps them)
EXTRA_ROW, ONE, ROWS_END = "attn.extra_row", "attn.one", "attn.rows.end"


def is_spare_row_node(node: onnx.NodeProto) -> bool:
    """Whether `node` is one of the spare row's: the Pad adding it, a `+ 1` on a length, the Slice dropping it."""
    if node.op_type == "Pad":
        return len(node.input) > 1 and node.input[1].endswith(EXTRA_ROW)
    if node.op_type == "Add":
        return any(i.endswith(ONE) for i in node.input)
    if node.op_type == "Slice":
        return len(node.input) > 2 and node.input[2].endswith(ROWS_END)
    return False


def lone_rows(stack: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of `stack` (a paired stack graph) with every spare-row node bypassed: each reader of its output
    reads its first input instead. Returns the copy and how many nodes went."""
    out = onnx.ModelProto()
    out.CopyFrom(stack)
    graph = out.graph
    bypass = {n.output[0]: n.input[0] for n in graph.node if is_spare_row_node(n)}
    need(bool(bypass), "internal: the stack graph has no spare attention row to leave out")
    graph_outputs = {o.name for o in graph.output}
    need(not bypass.keys() & graph_outputs, "internal: a spare-row node writes a graph output")

    def source(name: str) -> str:
        while name in bypass:
            name = bypass[name]
        return name

    nodes = [n for n in graph.node if n.output[0] not in bypass]
    for n in nodes:
        n.input[:] = [source(i) for i in n.input]
    del graph.node[:]
    graph.node.extend(nodes)
    # the now unread constants (pads, one, slice bounds) go too
    read = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in read or t.name in graph_outputs]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.name = "stack_lone"
    return out, len(bypass)
