"""Attention of a sliding-window layer (Gemma 3) over its ring cache, in a fused layer graph (kv_layout "inplace").

GroupQueryAttention cannot keep a ring: it writes new rows at the filled length of a max_seq cache and masks
by row index (its `local_window_size` only narrows what it reads of that full-length cache). So a sliding
layer writes its ring and attends with standard ops:

    present_k = ScatterElements(past_k, slots, k_new, axis=2)     slots = (L + j) % R, L = total_len - S
    scores    = (q * scale) . present_k^T  + mask                 [1, KV, G*S, R]
    out       = Softmax(scores) . present_v

present_* is bound to the past_* buffer (the runtime's in-place contract), and attention reads present_* —
the ScatterElements output — so the write happens before every read by data dependency alone. Reading the
ring after the write is exact when it has R = window + prefill_chunk - 1 rows (graphio.cache_rows): the S <=
prefill_chunk new rows then overwrite only positions no query of the chunk can reach. Row r holds position
p_r = T-1 - ((T-1-r) mod R), T = total_len (the newest position with that residue, negative: never written);
a query at position q sees it when 0 <= q - p_r < window. Keys are cached after RoPE, so their order in the
ring does not matter to the softmax. Nothing here depends on S but through Shape(q), so both variants of a
layer are the same graph (pairing.py).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper


def ring_attention(b, p: str, q: str, k: str, v: str, past_k: str, past_v: str, total_len: str,
                   heads: int, kv: int, hd: int, rows: int, window: int, scale: float) -> tuple[str, str, str]:
    """q [1,S,H*hd], k/v [1,S,KV*hd] (RoPE applied), past_* [1,KV,R,hd] -> (attention [1,S,H*hd], present_k,
    present_v). `b` is a graph_builder.GraphBuilder; `p` the layer's initializer prefix."""
    made: dict[str, str] = {}

    def const(name: str, value: np.ndarray) -> str:  # made once per name; 0-d stays 0-d (Range takes scalars)
        if name not in made:
            b.inits.append(numpy_helper.from_array(value, p + name))
            made[name] = p + name
        return made[name]

    def i64(name: str, value) -> str:
        return const(name, np.array(value, np.int64))

    seq = b.op("Gather", [b.op("Shape", [q])[0], i64("ring.one", 1)], axis=0)[0]  # S, int64 scalar
    total = b.op("Cast", [total_len], to=TensorProto.INT64)[0]
    start = b.op("Sub", [total, seq])[0]  # L: the first new position
    qpos = b.op("Add", [b.op("Range", [i64("ring.zero", 0), seq, i64("ring.one", 1)])[0], start])[0]  # [S]
    slots = b.op("Mod", [qpos, i64("ring.rows", rows)])[0]  # [S], qpos >= 0

    def heads_first(x: str, n: str, count: int) -> str:  # [1,S,n*hd] -> [1,n,S,hd]
        x = b.op("Reshape", [x, i64(f"ring.{n}.heads", [0, 0, count, hd])])[0]
        return b.op("Transpose", [x], perm=[0, 2, 1, 3])[0]

    idx = b.op("Expand", [b.op("Reshape", [slots, i64("ring.slot_shape", [1, 1, -1, 1])])[0],
                          b.op("Concat", [i64("ring.lead", [1, kv]), b.op("Unsqueeze", [seq, i64("ring.axis0", [0])])[0],
                                          i64("ring.hd", [hd])], axis=0)[0]])[0]  # [1,KV,S,hd]
    present_k = b.op("ScatterElements", [past_k, idx, heads_first(k, "k", kv)], axis=2)[0]
    present_v = b.op("ScatterElements", [past_v, idx, heads_first(v, "v", kv)], axis=2)[0]

    # the mask [S, R] -> [G*S, R] (query rows are head-major within a kv group: row g*S + j)
    last = b.op("Sub", [total, i64("ring.one", 1)])[0]
    back = b.op("Mod", [b.op("Sub", [b.op("Add", [last, i64("ring.rows", rows)])[0],
                                     i64("ring.range", np.arange(rows))])[0], i64("ring.rows", rows)])[0]
    pos = b.op("Sub", [last, back])[0]  # [R]: the position each row holds (< 0: never written)
    rel = b.op("Sub", [b.op("Unsqueeze", [qpos, i64("ring.axis1", [1])])[0], pos])[0]  # [S, R]: q - p_r
    ok = b.op("And", [b.op("And", [b.op("GreaterOrEqual", [pos, i64("ring.zero", 0)])[0],
                                   b.op("GreaterOrEqual", [rel, i64("ring.zero", 0)])[0]])[0],
                      b.op("Less", [rel, i64("ring.window", window)])[0]])[0]
    bias = b.op("Where", [ok, const("ring.open", np.array(0.0, np.float32)),
                          const("ring.shut", np.array(-np.inf, np.float32))])[0]
    bias = b.op("Tile", [bias, i64("ring.groups", [heads // kv, 1])])[0]  # [G*S, R]

    qg = b.op("Reshape", [heads_first(q, "q", heads), i64("ring.grouped", [1, kv, -1, hd])])[0]  # [1,KV,G*S,hd]
    qg = b.op("Mul", [qg, const("ring.scale", np.array(scale, np.float32))])[0]
    keys_t = b.op("Transpose", [present_k], perm=[0, 1, 3, 2])[0]
    scores = b.op("Add", [b.op("MatMul", [qg, keys_t])[0], bias])[0]
    out = b.op("MatMul", [b.op("Softmax", [scores], axis=-1)[0], present_v])[0]  # [1,KV,G*S,hd]
    out = b.op("Reshape", [out, i64("ring.ungrouped", [1, heads, -1, hd])])[0]
    out = b.op("Transpose", [out], perm=[0, 2, 1, 3])[0]
    return b.op("Reshape", [out, i64("ring.flat", [0, 0, heads * hd])])[0], present_k, present_v
