"""The lm_head by rows: int8 for the vocabulary rows that carry the probability, int4 for the rest.

Decode reads the whole lm_head every token; with an int8 head an int4 model spends a quarter of its bytes
per token there (Qwen2.5-0.5B: 144 of 345 MB), yet the error of a row only reaches the output distribution
through its token's probability: to second order, the KL an error d [V] in the logits adds is
1/2 Var_p(d) <= 1/2 sum_t p_t d_t^2. So row t is worth int8 by

    importance_t = sum over calibration rows x of  p_t(x) * (x . (w_t - q4(w_t)))^2

(p: the fp32 model's softmax at x; q4: the int4 scheme the rest of the rows get), and `--lm-head-int8-rows F`
keeps the F * V most important rows int8.

The split is made on the fp32 graphs, before the generic rewrite, so every later step (MatMulNBits packing,
the tied lookup reading the head's codes, pairing, the stack) sees two ordinary tables:
  head    Gemm(h, E, transB=1) [n, V]  ->  Gemm(h, E_hi) [n, N1], Gemm(h, E_lo) [n, N2] --Concat--> [n, V]
          in split order, the logits' columns (`HeadSplit.columns`: manifest format 12 `logit_columns`, read
          by runtime/columns.py; putting them back in vocabulary order in the graph, GatherElements over an
          expanded [n, V] index, cost up to 1.2 ms per verification at V = 151936); a MatMul(h, W [D, V]) head likewise;
  lookup  Gather(E, ids) -> pos = Gather(pos_of, ids); Where(pos < N1, Gather(E_hi, min(pos, N1 - 1)),
          Gather(E_lo, max(pos - N1, 0)))   (a tied table: one copy of each part serves both uses)
`pos_of` [V] int32: the position of token t in the split order (hi rows, then lo rows, each in id order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import safe_join
from edgellm.runtime.manifest import Manifest

from .onnxedit import load_graph
from .schemes import Scheme, dequantize, quantize

HI, LO = "hi", "lo"      # the parts' name suffixes: `lm_head.hi.weight` (int8), `lm_head.lo.weight` (int4)


def part_name(table: str, part: str) -> str:
    """`embed.weight` -> `embed.hi.weight`: the parts keep the table's module prefix and `.weight`."""
    stem = table.removesuffix(".weight")
    return f"{stem}.{part}.weight"


@dataclass(frozen=True)
class HeadSplit:
    table: str            # the fp32 head's initializer: `embed.weight` (tied) or `lm_head.weight`
    hi: np.ndarray        # bool [V]: the rows kept int8

    @property
    def parts(self) -> frozenset[str]:
        return frozenset({part_name(self.table, HI), part_name(self.table, LO)})

    @property
    def pos_of(self) -> np.ndarray:
        """int32 [V]: the position of each token in the split order (the tied lookup's table)."""
        pos = np.empty(self.hi.shape[0], np.int32)
        pos[split_order(self.hi)] = np.arange(self.hi.shape[0], dtype=np.int32)
        return pos

    @property
    def columns(self) -> np.ndarray:
        """int32 [V]: the token id of each column of the split head's logits (hi rows, then lo rows)."""
        return split_order(self.hi).astype(np.int32)


def split_order(hi: np.ndarray) -> np.ndarray:
    """The split order of the rows: the hi rows' ids ascending, then the lo rows' (`choose_rows`' mask)."""
    return np.concatenate([np.flatnonzero(hi), np.flatnonzero(~hi)])


def plan_split(src: Path, manifest: Manifest, samples: dict[str, np.ndarray], fraction: float,
               low: Scheme) -> HeadSplit:
    """The rows of the fp32 export's head to keep int8, from the calibration's sampled head inputs."""
    tied = bool(manifest.config.get("tie_embeddings"))
    table = "embed.weight" if tied else "lm_head.weight"
    head = next((g for g in manifest.graphs if g.role == "head"), None)
    need(head is not None, f"{src}: --lm-head-int8-rows: the export has no head graph")
    w = head_rows(load_graph(safe_join(src, head.file), True).graph, table)
    x = samples.get(table)
    need(x is not None and len(x) > 0, f"{src}: --lm-head-int8-rows: the calibration saw no input of {table}")
    return HeadSplit(table, choose_rows(row_importance(x, w, low), fraction))


def head_rows(graph: onnx.GraphProto, table: str) -> np.ndarray:
    """The head's weight as rows [V, D] (a Gemm reads it transposed: as stored; a MatMul [D, V]: transposed)."""
    init = next((t for t in graph.initializer if t.name == table), None)
    if init is None:
        raise EdgeError(f"--lm-head-int8-rows: the head graph has no {table}")
    w = numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Gemm" and node.input[1] == table:
            return w if any(a.name == "transB" and a.i == 1 for a in node.attribute) else w.T
        if node.op_type == "MatMul" and node.input[1] == table:
            return np.ascontiguousarray(w.T)
    raise EdgeError(f"--lm-head-int8-rows: no MatMul or Gemm reads {table} in the head graph")


def row_importance(x: np.ndarray, w: np.ndarray, low: Scheme, chunk: int = 8192) -> np.ndarray:
    """importance_t [V] float64 (module docstring) of head rows w [V, D] over calibration inputs x [R, D]."""
    x = np.asarray(x, np.float32)
    total = np.zeros(w.shape[0], np.float64)
    logits = np.concatenate([x @ w[i:i + chunk].T for i in range(0, w.shape[0], chunk)], axis=1)  # [R, V]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    for i in range(0, w.shape[0], chunk):
        rows = w[i:i + chunk]
        err = rows - dequantize(quantize(rows, low))
        d = x @ err.T                                                         # [R, chunk] logit errors
        total[i:i + chunk] = (p[:, i:i + chunk] * d * d).sum(axis=0, dtype=np.float64)
    return total


def choose_rows(importance: np.ndarray, fraction: float) -> np.ndarray:
    """bool [V]: the round(fraction * V) most important rows (ties to the lower id), at least one of each part."""
    v = importance.shape[0]
    n = min(max(int(round(fraction * v)), 1), v - 1)
    order = np.lexsort((np.arange(v), -importance))
    hi = np.zeros(v, bool)
    hi[order[:n]] = True
    return hi


def split_head(model: onnx.ModelProto, table: str, hi: np.ndarray) -> bool:
    """Rewrite, in place, every use of the fp32 initializer `table` (a head MatMul/Gemm, a tied row Gather)
    into the two parts; False if the graph does not read it. `hi`: bool [V] from `choose_rows`."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    if table not in inits:
        return False
    w = numpy_helper.to_array(inits[table])
    pos_of = HeadSplit(table, hi).pos_of
    n_hi = int(hi.sum())
    new_nodes: list[onnx.NodeProto] = []
    used = False
    added: dict[str, onnx.TensorProto] = {}

    def init(name: str, value: np.ndarray) -> str:
        if name not in added:
            added[name] = numpy_helper.from_array(np.ascontiguousarray(value), name)
        return name

    for node in graph.node:
        if table not in node.input:
            new_nodes.append(node)
            continue
        used = True
        p, out = node.name or node.output[0], node.output[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gather" and attrs.get("axis", 0) == 0 and node.input[0] == table:
            new_nodes += _lookup(node, w, hi, pos_of, n_hi, table, init)
            continue
        rows_are_n = node.op_type == "Gemm" and attrs.get("transB", 0) == 1 and node.input[1] == table
        cols_are_n = node.op_type == "MatMul" and node.input[1] == table
        if not (rows_are_n or cols_are_n) or len(node.input) > 2:
            raise EdgeError(f"{table}: read by {node.op_type} {p}, which the row split does not rewrite (an "
                            "export of an older format: re-export it, or quantize with --lm-head-int8-rows 1)")
        parts = []
        for part, sel in ((HI, hi), (LO, ~hi)):
            name = init(part_name(table, part), w[sel] if rows_are_n else w[:, sel])
            o = f"{out}/{part}"
            new_nodes.append(helper.make_node(node.op_type, [node.input[0], name], [o], name=f"{p}/{part}",
                                              **attrs))
            parts.append(o)
        # the logits in split order: the runtime reads them through the manifest's logit_columns
        new_nodes.append(helper.make_node("Concat", parts, [out], name=f"{p}/concat", axis=-1))
    if not used:
        return False
    graph.ClearField("node")
    graph.node.extend(new_nodes)
    kept = [t for t in graph.initializer if t.name != table]
    graph.ClearField("initializer")
    graph.initializer.extend(kept + list(added.values()))
    return True


def _lookup(node: onnx.NodeProto, w: np.ndarray, hi: np.ndarray, pos_of: np.ndarray, n_hi: int, table: str,
            init) -> list[onnx.NodeProto]:
    """Gather(E, ids) [.., D] -> the same rows from the two parts (module docstring)."""
    ids, out, p = node.input[1], node.output[0], node.name or node.output[0]
    t = {k: f"{out}/{k}" for k in ("pos", "is_hi", "is_hi_d", "i_hi", "shift", "i_lo", "r_hi", "r_lo")}
    e_hi, e_lo = init(part_name(table, HI), w[hi]), init(part_name(table, LO), w[~hi])
    pos = init(f"{table}.pos_of", pos_of)
    n1 = init(f"{table}.n_hi", np.array(n_hi, np.int32))
    last = init(f"{table}.last_hi", np.array(n_hi - 1, np.int32))
    zero = init(f"{table}.zero", np.array(0, np.int32))
    minus1 = init(f"{table}.axis_last", np.array([-1], np.int64))
    return [helper.make_node("Gather", [pos, ids], [t["pos"]], name=f"{p}/pos", axis=0),
            helper.make_node("Less", [t["pos"], n1], [t["is_hi"]], name=f"{p}/is_hi"),
            helper.make_node("Unsqueeze", [t["is_hi"], minus1], [t["is_hi_d"]], name=f"{p}/is_hi_d"),
            helper.make_node("Min", [t["pos"], last], [t["i_hi"]], name=f"{p}/i_hi"),
            helper.make_node("Sub", [t["pos"], n1], [t["shift"]], name=f"{p}/shift"),
            helper.make_node("Max", [t["shift"], zero], [t["i_lo"]], name=f"{p}/i_lo"),
            helper.make_node("Gather", [e_hi, t["i_hi"]], [t["r_hi"]], name=f"{p}/hi", axis=0),
            helper.make_node("Gather", [e_lo, t["i_lo"]], [t["r_lo"]], name=f"{p}/lo", axis=0),
            helper.make_node("Where", [t["is_hi_d"], t["r_hi"], t["r_lo"]], [out], name=f"{p}/rows")]
