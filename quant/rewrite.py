"""Rewrite the float weights of a loaded `onnx.ModelProto` (external data resolved) into quantized ones.

    MatMul(A, B [K,N] init)  or  Gemm(A, B, C?, transB) with alpha = beta = 1, transA = 0
      fast:      A --MatMulNBits(B_q [N,nb,blob], scales [N,nb], zp?)--> Y  [--Add(C)--> Y]
                 (with the plan's fp16_scales: scales16 [N,nb] float16 --Cast--> scales, a prologue node)
                 block offsets (schemes.Scheme.offsets): Y = MatMulNBits(...) + MatMulNBits(A's block means
                 [1, S, nb], 8-bit (block * offsets) [nb, N]), the means once per activation (`Builder.block_means`)
      portable:  B_q [K,N] --DequantizeLinear(scale, zp?)--> B' ;  A --MatMul(B')--> Y  [--Add(C)--> Y]
    Gather(E [V,D] init, ids, axis=0)  (the token embedding; int8 per row only)
      ids --Gather(E_q [V,D] int8)--Cast(float)--[Sub(Cast(Gather(zp [V,1])))]--Mul(Gather(scale [V,1]))--> Y
      so only the S gathered rows are dequantized, never the table.

A `QuantPlan` (plan.py) picks a `QuantSpec` (or None = keep fp32) per weight from a `WeightSite` (initializer
name, torch module path from the exporter's metadata, op, shape), so callers can mix precisions. Weights are
quantized once per initializer even if several nodes share it (and once per plan across graphs, see
`QuantPlan.quantize`); replaced initializers no longer used are dropped. onnxruntime note: with graph
optimizations on, it fuses DequantizeLinear -> MatMul into MatMulNBits with `accuracy_level` = session
config `session.qdq_matmulnbits_accuracy_level` (default 4), so on onnxruntime the portable format runs
the same kernels as `fast`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgellm.runtime.errors import need

from .builder import Builder
from .methods import QuantSpec
from .onnxedit import prune_initializers, require_opset
from .packing import NBitsArrays, to_dequantize_linear
from .plan import (
    DEFAULT_ACCURACY_LEVEL,
    FORMATS,
    QuantPlan,
    WeightReport,
    WeightSite,
    by_pattern,
)
from .schemes import QuantizedWeight, offset_term, snapped_term
from .sites import module_of, weight_use

# the plan types lived here first: importers of rewrite keep working
__all__ = ["DEFAULT_ACCURACY_LEVEL", "FORMATS", "QuantPlan", "QuantSpec", "WeightReport", "WeightSite",
           "by_pattern", "quantize_model"]

# ---------------------------------------------------------------- building replacements

@dataclass(frozen=True)
class OffsetTerm:
    """A weight's block-offset term: MatMulNBits(block means of A, *inputs, **attrs), added to its output."""

    inputs: list[str]   # 8-bit: weights [N, nb/16, 16], scales [N, nb/16]; else one float [nb, N] for a MatMul
    attrs: dict         # 8-bit: MatMulNBits' K (= the weight's blocks), N, bits, block_size; else {}
    k: int              # the weight's K
    block: int          # the weight's block, over which A is averaged


def _nbits_inputs(b: Builder, name: str, qw: QuantizedWeight, plan: QuantPlan,
                  ) -> tuple[list[str], int, dict, OffsetTerm | None]:
    """MatMulNBits weight inputs [B, scales, zp?], their bytes, the shape attributes and, for block offsets, the
    offset term."""
    arr = plan.nbits(qw)
    names, total = [b.array(f"{name}.q", arr.b)[0]], arr.b.nbytes
    if plan.half_scales(arr, arr.scales):
        # stored fp16; MatMulNBits takes the activations' type, so a Cast (folded at session creation)
        scales, total = b.cast_fp16(f"{name}.scales", arr.scales), total + arr.scales.size * 2
    else:
        scales, total = b.array(f"{name}.scales", arr.scales)[0], total + arr.scales.nbytes
    names.append(scales)
    if arr.zero_points is not None:
        names.append(b.array(f"{name}.zp", arr.zero_points)[0])
        total += arr.zero_points.nbytes
    attrs = {"K": arr.k, "N": arr.n, "bits": arr.bits, "block_size": arr.block_size}
    if arr.offsets is None:
        return names, total, attrs, None
    term, size = _offset_term(b, name, arr, scales, plan)
    return names, total + size, attrs, term


def _offset_term(b: Builder, name: str, arr: NBitsArrays, scales: str, plan: QuantPlan) -> tuple[OffsetTerm, int]:
    """The block offsets' term: (A's block means [1, S, nb]) @ (m + 8 s) * block [nb, N] (schemes.offset_term),
    the codes running symmetric, (code - 8) * s. Searched offsets put it on an 8-bit grid (methods.snap_offsets):
    an 8-bit MatMulNBits, which onnxruntime packs once and the runtime releases the mapped pages of (a float MatMul
    over fp16 offsets kept the float32 copy its prologue folded: Qwen2.5-0.5B 45 MB). Offsets kept as a source
    stored them (a Q4_K grid, `--block-min auto`) keep a float term, exact: float32, or fp16 folded at load."""
    snapped = snapped_term(arr.offsets, arr.scales, arr.block_size)
    if snapped is not None:
        term = plan.nbits(snapped)
        inputs = [b.array(f"{name}.offsets.q", term.b)[0], b.array(f"{name}.offsets.scales", term.scales)[0]]
        attrs = {"K": term.k, "N": term.n, "bits": 8, "block_size": term.block_size}
        return OffsetTerm(inputs, attrs, arr.k, arr.block_size), term.b.nbytes + term.scales.nbytes
    m, block = np.ascontiguousarray(arr.offsets.T), np.float32(arr.block_size)
    if plan.half_scales(arr, m):    # m fp16 beside the fp16 scales; the weights folded at session creation
        p = b.fresh(f"{name}.offsets")
        s_t, s8, o = f"{p}/scales_t", f"{p}/scales_x8", f"{p}/sum"
        b.prologue += [helper.make_node("Transpose", [scales], [s_t], name=s_t, perm=[1, 0]),
                       helper.make_node("Mul", [s_t, b.const("offsets.eight", np.array(8, np.float32))], [s8], name=s8),
                       helper.make_node("Add", [b.cast_fp16(f"{name}.minima", m), s8], [o], name=o),
                       helper.make_node("Mul", [o, b.const(f"offsets.block{arr.block_size}", np.array(block))], [p],
                                        name=p)]
        return OffsetTerm([p], {}, arr.k, arr.block_size), m.size * 2 + 8
    o = np.ascontiguousarray(offset_term(arr.offsets, arr.scales, arr.block_size).T)
    return OffsetTerm([b.array(f"{name}.offsets", o)[0]], {}, arr.k, arr.block_size), o.nbytes


def _dq_output(b: Builder, name: str, qw: QuantizedWeight) -> tuple[str, int]:
    """DequantizeLinear(B_q [K,N]) as a prologue node; returns its output name and the bytes stored."""
    arr = to_dequantize_linear(qw)
    signed = arr.zero_point is None
    store = b.int4 if arr.bits == 4 else (lambda base, v, _s: b.array(base, v))
    x, total = store(f"{name}.q", arr.x, signed)
    scale, size = b.array(f"{name}.scale", arr.scale)
    inputs, total = [x, scale], total + size
    if arr.zero_point is not None:
        zp, size = store(f"{name}.zp", arr.zero_point, False)
        inputs, total = inputs + [zp], total + size
    attrs = {"axis": arr.axis} | ({"block_size": arr.block_size} if arr.block_size else {})
    out = b.fresh(f"{name}.dq")
    b.prologue.append(helper.make_node("DequantizeLinear", inputs, [out], name=out, **attrs))
    return out, total


def _matmul_nodes(node: onnx.NodeProto, core: onnx.NodeProto, b: Builder, offsets: OffsetTerm | None = None,
                  accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> list[onnx.NodeProto]:
    """`core` computes A @ W^T into the node's output; a Gemm's bias C becomes a following Add, and block
    `offsets` a term (block means of A) @ offsets added before it."""
    out, nodes, adds = node.output[0], [], []
    if offsets is not None:
        means = b.block_means(node.input[0], offsets.k, offsets.block, nodes)
        term = b.fresh(f"{out}/offsets")
        if offsets.attrs:
            nodes.append(helper.make_node("MatMulNBits", [means, *offsets.inputs], [term], name=term,
                                          domain="com.microsoft", accuracy_level=accuracy_level, **offsets.attrs))
        else:
            nodes.append(helper.make_node("MatMul", [means, *offsets.inputs], [term], name=term))
        adds.append((term, f"{node.name}/offsets_add"))
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        adds.append((node.input[2], f"{node.name}/bias"))
    y = out if not adds else b.fresh(f"{out}/matmul")
    core.output[:] = [y]
    nodes.append(core)
    for i, (addend, add_name) in enumerate(adds):
        nxt = out if i == len(adds) - 1 else b.fresh(f"{out}/sum")
        nodes.append(helper.make_node("Add", [y, addend], [nxt], name=add_name))
        y = nxt
    return nodes


def _gather_tables(b: Builder, name: str, qw: QuantizedWeight) -> tuple[list[str], int]:
    """Int8 per-row embedding tables [codes [V,D], scale [V,1], zp [V,1]?] and their bytes."""
    s = qw.scheme
    need(s.bits == 8 and s.block_size == 0,
         f"embedding {name}: only int8 per-row (block 0) is supported for Gather, got {s.label}")
    codes = qw.codes[:, :qw.k]
    parts = [("q", (codes.astype(np.int16) - s.mid).astype(np.int8) if s.symmetric else codes),
             ("scale", qw.scales[:, :1])]                   # [V, 1]: gathers to [..., 1]
    if not s.symmetric:
        parts.append(("zp", qw.zero_points[:, :1]))
    made = [b.array(f"{name}.{suffix}", value) for suffix, value in parts]
    return [n for n, _ in made], sum(size for _, size in made)


def _gather_nodes(node: onnx.NodeProto, tables: list[str], b: Builder) -> list[onnx.NodeProto]:
    """Gather codes and row scales, then dequantize only the gathered rows."""
    ids, out, p = node.input[1], node.output[0], node.name or node.output[0]
    rows, rows_f, scale = b.fresh(f"{out}/q_rows"), b.fresh(f"{out}/rows"), b.fresh(f"{out}/scale")
    nodes = [helper.make_node("Gather", [tables[0], ids], [rows], name=f"{p}/q", axis=0),
             helper.make_node("Cast", [rows], [rows_f], name=f"{p}/cast", to=TensorProto.FLOAT),
             helper.make_node("Gather", [tables[1], ids], [scale], name=f"{p}/scale", axis=0)]
    if len(tables) == 3:                                    # asymmetric: subtract the row zero point
        zp, zp_f, centred = b.fresh(f"{out}/zp"), b.fresh(f"{out}/zp_f"), b.fresh(f"{out}/centred")
        nodes += [helper.make_node("Gather", [tables[2], ids], [zp], name=f"{p}/zp", axis=0),
                  helper.make_node("Cast", [zp], [zp_f], name=f"{p}/zp_cast", to=TensorProto.FLOAT),
                  helper.make_node("Sub", [rows_f, zp_f], [centred], name=f"{p}/centre")]
        rows_f = centred
    nodes.append(helper.make_node("Mul", [rows_f, scale], [out], name=f"{p}/dequant"))
    return nodes


# ---------------------------------------------------------------- the rewrite

def quantize_model(model: onnx.ModelProto, plan: QuantPlan) -> list[WeightReport]:
    """Rewrite `model` in place following `plan`; one report per candidate weight (kept ones as "fp32")."""
    graph = model.graph
    graph_inputs = {v.name for v in graph.input}
    inits = {t.name: t for t in graph.initializer if t.name not in graph_inputs}   # inputs can be overridden
    nodes = list(graph.node)
    uses: dict[tuple[str, str], list[int]] = {}             # (initializer, layout) -> node indices
    for i, node in enumerate(nodes):
        hit = weight_use(node, inits)
        if hit is not None and not (hit[1] == "rows" and hit[0] in plan.tied):  # tied lookups: quant/tied.py
            uses.setdefault(hit, []).append(i)

    b = Builder(graph)
    replace: dict[int, list[onnx.NodeProto]] = {}           # node index -> its replacement
    reports: list[WeightReport] = []
    opset_needed = 0
    for (name, layout), where in uses.items():
        w = numpy_helper.to_array(inits[name])
        w = np.ascontiguousarray(w.T if layout == "kn" else w)  # canonical [N, K], rows contiguous
        first = nodes[where[0]]
        site = WeightSite(name, first.op_type, first.name, module_of(first, name), w.shape)
        spec = plan.choose(site)
        if spec is None:
            reports.append(WeightReport(name, site.module, site.op, site.shape, "fp32", w.nbytes, w.nbytes, 0.0, 0.0))
            continue
        qw, err = plan.quantize(site, w, spec)                  # memoised: once per weight and content
        if layout == "rows":
            tables, nbytes = _gather_tables(b, name, qw)
            for i in where:
                replace[i] = _gather_nodes(nodes[i], tables, b)
        elif plan.format == "fast":
            inputs, nbytes, shape_attrs, offsets = _nbits_inputs(b, name, qw, plan)
            for i in where:
                core = helper.make_node("MatMulNBits", [nodes[i].input[0], *inputs], [], name=nodes[i].name,
                                        domain="com.microsoft", accuracy_level=plan.accuracy_level, **shape_attrs)
                replace[i] = _matmul_nodes(nodes[i], core, b, offsets, plan.accuracy_level)
        else:
            dq, nbytes = _dq_output(b, name, qw)
            opset_needed = max(opset_needed, 21 if spec.scheme.bits == 4 or spec.scheme.block_size else 13)
            for i in where:
                core = helper.make_node("MatMul", [nodes[i].input[0], dq], [], name=nodes[i].name)
                replace[i] = _matmul_nodes(nodes[i], core, b)
        reports.append(WeightReport(name, site.module, site.op, site.shape, plan.label(site, spec), w.nbytes, nbytes,
                                    err.max_abs_err, err.rel_rms_err))

    new_nodes = list(b.prologue)
    for i, node in enumerate(nodes):
        new_nodes.extend(replace.get(i, [node]))
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    graph.initializer.extend(b.inits)
    prune_initializers(graph, {name for name, _ in uses})  # the replaced ones
    if any(n.domain == "com.microsoft" for n in graph.node):
        require_opset(model, "com.microsoft", 1)
    if opset_needed:
        # ops whose meaning changed in opsets 19..21 (decoder graphs use none): refuse rather than alter them
        changed = {n.op_type for n in graph.node} & {"DFT", "GroupNormalization"}
        need(not changed or _opset(model) >= opset_needed,
             f"portable format needs opset {opset_needed}, but raising it would change {sorted(changed)}: "
             f"export at opset {opset_needed} instead")
        require_opset(model, "", opset_needed)
        model.ir_version = max(model.ir_version, 10)          # int4 and opset 21 need IR 10
    return reports


def _opset(model: onnx.ModelProto) -> int:
    return next((op.version for op in model.opset_import if op.domain in ("", "ai.onnx")), 0)
