"""The tied embedding: row lookups in the table the lm_head multiplies by, quantized without a second table.

A tied export stores the table once, E [V, D]: the head reads it as `Gemm(h, E, transB=1)` and the embedding
gathers rows of it, `Gather(E, ids [S], axis=0) -> [S, D]` (export/graphs.py `_embed_lookup`; the plan names
it in `QuantPlan.tied`, so the generic rewrite leaves the lookup alone). Exports before 2026-11-26 stored
E^T [D, V] for a MatMul head and gathered columns, `Gather(E^T, ids, axis=1) -> [D, S]`: still read. Here
either Gather becomes a lookup in the quantized codes:
  shared   the lm_head is quantized and the format can gather its codes (fast: any bits and block;
           portable: 8 bits): the Gather reads the lm_head's very initializers (same names, same bytes),
           so the data file holds the table once and both uses see the same dequantized values;
  separate otherwise (lm_head fp32, or portable int4: ONNX int4 tensors cannot be gathered by every
           onnxruntime >= 1.22): a per-row int8 table of its own beside the lm_head's copy.
Both formats dequantize only the S gathered rows:
  fast      B [V, nb, bs*bits/8] uint8 (MatMulNBits layout) --Gather(ids)--> [S, nb, .] --Cast-->
            (4 bits: hi = Floor(x / 16), lo = x - 16 hi, interleaved lo first -> [S, nb, bs])
            --Sub zp, Mul scale [S, nb, 1]--> Reshape [S, nb*bs] --Slice [:D]--> [S, D] (--Transpose--> [D, S]
            for a column lookup) (plain ONNX ops, no com.microsoft GatherBlockQuantized: same numerics on every
            version)
  portable  X [D, V] int8 (DequantizeLinear layout) --Gather(ids, axis=1)--> [D, S]
            --DequantizeLinear(Gather(scale [V] | [nb, V], axis=-1), Gather(zp)?, axis=1 | 0 + block)
            (--Transpose--> [S, D] for a row lookup)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgellm.runtime.errors import need

from .onnxedit import require_opset
from .packing import to_dequantize_linear
from .plan import QuantPlan, WeightReport, WeightSite
from .schemes import QuantizedWeight


def _tied_gathers(graph: onnx.GraphProto, tied: frozenset[str]) -> list[tuple[int, str, bool]]:
    """(node index, table name, rows?) of every tied lookup in a 2-D float32 initializer: Gather(axis=0) of a
    table in `tied` (rows), or Gather(axis=1) of any (columns of E^T, the layout before 2026-11-26)."""
    inits = {t.name: t for t in graph.initializer}
    found = []
    for i, node in enumerate(graph.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        t = inits.get(node.input[0])
        if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
            continue
        if axis == 1 or (axis == 0 and node.input[0] in tied):
            found.append((i, node.input[0], axis == 0))
    return found


class _Inits:
    """New initializers for one graph; a name already holding the same bytes is reused (the lm_head's
    tensors in a one-graph export), another name is made unique."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.by_name = {t.name: t for t in graph.initializer}
        self.taken = set(self.by_name) | {o for n in graph.node for o in n.output} | {v.name for v in graph.input}

    def add(self, base: str, value: np.ndarray) -> str:
        tensor = numpy_helper.from_array(np.ascontiguousarray(value), base)
        old = self.by_name.get(base)
        if old is not None and old.raw_data == tensor.raw_data and list(old.dims) == list(tensor.dims) \
                and old.data_type == tensor.data_type:
            return base
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}.{i}", i + 1
        tensor.name = name
        self.taken.add(name)
        self.by_name[name] = tensor
        self.graph.initializer.append(tensor)
        return name


def _fast_nodes(node: onnx.NodeProto, qw: QuantizedWeight, base: str, plan: QuantPlan, inits: _Inits,
                d: int, rows_out: bool) -> tuple[list[onnx.NodeProto], int]:
    arr = plan.nbits(qw)
    ids, out, p = node.input[1], node.output[0], node.name or node.output[0]
    nb, bs = arr.b.shape[1], arr.block_size
    half = plan.half_scales(arr, arr.scales)    # the head's fp16 copy (rewrite.py), cast per row
    b = inits.add(f"{base}.q", arr.b)
    scales = inits.add(f"{base}.scales16", arr.scales.astype(np.float16)) if half else \
        inits.add(f"{base}.scales", arr.scales)
    stored = arr.b.nbytes + (arr.scales.nbytes // 2 if half else arr.scales.nbytes)
    axes = inits.add(f"{base}.axes_last", np.array([-1], np.int64))
    names = ("q", "qf", "zp", "zpf", "zpu", "c", "s", "su", "r3", "r2", "rows", "hi", "hi16", "lo", "loU", "hiU",
             "pair", "qb")
    t = {k: f"{out}/{k}" for k in names}
    nodes = [helper.make_node("Gather", [b, ids], [t["q"]], name=f"{p}/q", axis=0),        # [S, nb, blob] uint8
             helper.make_node("Cast", [t["q"]], [t["qf"]], name=f"{p}/cast", to=TensorProto.FLOAT)]
    if arr.bits == 4:                      # two codes per byte, low nibble first -> [S, nb, bs] float
        bs = 2 * arr.b.shape[2]
        sixteen = inits.add(f"{base}.sixteen", np.array(16.0, np.float32))
        blocks = inits.add(f"{base}.blocks_shape", np.array([0, nb, bs], np.int64))
        nodes += [helper.make_node("Div", [t["qf"], sixteen], [t["hi16"]], name=f"{p}/div16"),
                  helper.make_node("Floor", [t["hi16"]], [t["hi"]], name=f"{p}/hi"),
                  helper.make_node("Mul", [t["hi"], sixteen], [t["lo"] + "/h"], name=f"{p}/hi_x16"),
                  helper.make_node("Sub", [t["qf"], t["lo"] + "/h"], [t["lo"]], name=f"{p}/lo"),
                  helper.make_node("Unsqueeze", [t["lo"], axes], [t["loU"]], name=f"{p}/lo_unsq"),
                  helper.make_node("Unsqueeze", [t["hi"], axes], [t["hiU"]], name=f"{p}/hi_unsq"),
                  helper.make_node("Concat", [t["loU"], t["hiU"]], [t["pair"]], name=f"{p}/pair", axis=-1),
                  helper.make_node("Reshape", [t["pair"], blocks], [t["qb"]], name=f"{p}/codes")]
        t["qf"] = t["qb"]
    if arr.zero_points is None:
        zero = inits.add(f"{base}.mid", np.array(qw.scheme.mid, np.float32))
    else:                                 # [V, nb] uint8 (4 bits: unpacked, the head's packed copy is not read)
        zps = arr.zero_points if arr.bits == 8 else qw.zero_points
        zp = inits.add(f"{base}.zp" if arr.bits == 8 else f"{base}.zp_rows", zps)
        stored += zps.nbytes
        nodes += [helper.make_node("Gather", [zp, ids], [t["zp"]], name=f"{p}/zp", axis=0),
                  helper.make_node("Cast", [t["zp"]], [t["zpf"]], name=f"{p}/zp_cast", to=TensorProto.FLOAT),
                  helper.make_node("Unsqueeze", [t["zpf"], axes], [t["zpu"]], name=f"{p}/zp_unsq")]
        zero = t["zpu"]
    shape = inits.add(f"{base}.rows_shape", np.array([0, nb * bs], np.int64))
    nodes += [helper.make_node("Sub", [t["qf"], zero], [t["c"]], name=f"{p}/centre"),
              helper.make_node("Gather", [scales, ids], [t["s"]], name=f"{p}/scale", axis=0)]  # [S, nb]
    if half:
        nodes.append(helper.make_node("Cast", [t["s"]], [t["s"] + "/f"], name=f"{p}/scale_cast", to=TensorProto.FLOAT))
        t["s"] += "/f"
    nodes += [helper.make_node("Unsqueeze", [t["s"], axes], [t["su"]], name=f"{p}/scale_unsq"),
              helper.make_node("Mul", [t["c"], t["su"]], [t["r3"]], name=f"{p}/dequant"),
              helper.make_node("Reshape", [t["r3"], shape], [t["r2"]], name=f"{p}/rows")]
    rows = t["r2"]
    if nb * bs != d:                                       # K padding of the blocks
        starts = inits.add(f"{base}.zero1", np.array([0], np.int64))
        ends = inits.add(f"{base}.dim", np.array([d], np.int64))
        one = inits.add(f"{base}.one1", np.array([1], np.int64))
        nodes.append(helper.make_node("Slice", [rows, starts, ends, one], [t["rows"]], name=f"{p}/unpad"))
    if rows_out:                                           # [S, D]: the last node writes the Gather's output
        nodes[-1].output[0] = out
    else:
        nodes.append(helper.make_node("Transpose", [nodes[-1].output[0]], [out], name=f"{p}/t", perm=[1, 0]))
    return nodes, stored


def _portable_nodes(node: onnx.NodeProto, qw: QuantizedWeight, base: str, inits: _Inits,
                    rows_out: bool) -> tuple[list[onnx.NodeProto], int]:
    arr = to_dequantize_linear(qw)                # x [D, V]; scale, zp? [V] per-axis or [nb, V] block-wise
    ids, p = node.input[1], node.name or node.output[0]
    out = f"{node.output[0]}/cols" if rows_out else node.output[0]
    x, scale = inits.add(f"{base}.q", arr.x), inits.add(f"{base}.scale", arr.scale)
    stored = arr.x.nbytes + arr.scale.nbytes
    nodes = [helper.make_node("Gather", [x, ids], [f"{out}/q"], name=f"{p}/q", axis=1),
             helper.make_node("Gather", [scale, ids], [f"{out}/scale"], name=f"{p}/scale", axis=arr.scale.ndim - 1)]
    dq_in = [f"{out}/q", f"{out}/scale"]
    if arr.zero_point is not None:
        zp = inits.add(f"{base}.zp", arr.zero_point)
        stored += arr.zero_point.nbytes
        nodes.append(helper.make_node("Gather", [zp, ids], [f"{out}/zp"], name=f"{p}/zp", axis=arr.scale.ndim - 1))
        dq_in.append(f"{out}/zp")
    block = {"axis": 0, "block_size": arr.block_size} if arr.block_size else {"axis": 1}
    nodes.append(helper.make_node("DequantizeLinear", dq_in, [out], name=f"{p}/dequant", **block))
    if rows_out:
        nodes.append(helper.make_node("Transpose", [out], [node.output[0]], name=f"{p}/t", perm=[1, 0]))
    return nodes, stored


def quantize_tied_gathers(model: onnx.ModelProto, plan: QuantPlan) -> list[WeightReport]:
    """Rewrite every tied embedding lookup the plan quantizes (see the module docstring); one report each.

    Run after `quantize_model` on the same plan, so a one-graph export finds the lm_head's tensors in place
    and the shared case hits the plan's memo. The fp32 table stays if anything still reads it.
    """
    graph = model.graph
    inits = _Inits(graph)
    reports, replace = [], {}
    for i, name, rows in _tied_gathers(graph, plan.tied):
        node = graph.node[i]
        table = numpy_helper.to_array(inits.by_name[name])          # E [V, D] (rows) or E^T [D, V]
        w = np.ascontiguousarray(table if rows else table.T)          # canonical [V, D] = the lm_head's [N, K]
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        site = WeightSite(name, "Gather", node.name, module, w.shape)
        spec = plan.choose(site)
        if spec is None:
            reports.append(WeightReport(name, module, "Gather", w.shape, "fp32", w.nbytes, w.nbytes, 0.0, 0.0))
            continue
        head = WeightSite(name, "MatMul", "", module, w.shape)
        head_spec = plan.choose(head)
        shared = head_spec is not None and (plan.format == "fast" or head_spec.scheme.bits == 8)
        need(shared or (spec.scheme.bits == 8 and spec.scheme.block_size == 0),
             f"embedding {name}: only int8 per-row is supported for a table of its own, got {spec.scheme.label}")
        use_site, use_spec = (head, head_spec) if shared and head_spec is not None else (site, spec)
        qw, err = plan.quantize(use_site, w, use_spec)
        base = name if shared else f"{name}.rows"
        if plan.format == "fast":
            nodes, stored = _fast_nodes(node, qw, base, plan, inits, w.shape[1], rows)
        else:
            nodes, stored = _portable_nodes(node, qw, base, inits, rows)
        replace[i] = nodes
        reports.append(WeightReport(name, module, "Gather", w.shape, plan.label(use_site, use_spec), w.nbytes,
                                    0 if shared else stored, err.max_abs_err, err.rel_rms_err,
                                    shared_with="lm_head" if shared else ""))
    if replace:
        nodes = [n for i, node in enumerate(graph.node) for n in replace.get(i, [node])]
        graph.ClearField("node")
        graph.node.extend(nodes)
        if any(n.op_type == "DequantizeLinear" for n in nodes):
            blocked = any(a.name == "block_size" for n in nodes if n.op_type == "DequantizeLinear" for a in n.attribute)
            require_opset(model, "", 21 if blocked else 13)
            if blocked:
                model.ir_version = max(model.ir_version, 10)
    return reports
