"""Decoder layers as hand-built graphs of onnxruntime's fused CPU kernels (`--attention fused`).

Why: the traced layer is 54 nodes after onnxruntime's optimiser (rotate-half as Split/Neg/Concat, the cache
mask as Less/Where, the [past | new] softmax as Concat/Split), and at the stories15M shape those small ops
took ~70 % of a decode step. Built from fused kernels the layer is ~12 nodes:

    SimplifiedLayerNormalization -> MatMul qkv (+ bias) [-> per-head q/k norm] ->
    GroupQueryAttention (RoPE inside, KV cache written in place) -> MatMul o ->
    SkipSimplifiedLayerNormalization (residual add + norm) -> MatMul gate_up -> Split -> SiLU * up ->
    MatMul down -> Add

Cache layout "inplace" (docs/design.md): `present_key.{i}` is the whole [1, n_kv, max_seq, hd] cache with rows
[past_len, past_len + S) written; the runtime binds it to the very buffer it passes as `past_key.{i}`, so
GroupQueryAttention appends in place and reads only the filled rows (`total_len`). The rows it writes are the
ones `runtime.kvcache.write_rows` would write; export-time verification checks exactly that.

Everything the seeds scale is folded into tables or weights, so no preset adds ops to the hot path:
- RoPE (rotate-half or interleaved, LongRoPE factors and mscale) -> the cos/sin caches, taken from the model's
  own `Rotary` at positions 0..max_seq-1;
- XPos -> separate q and k caches (cos * scale, sin * scale; scale is per frequency pair, so it commutes with
  the rotation), applied by two RotaryEmbedding ops before attention (GroupQueryAttention has one cache);
- LayerScale gamma and the MiniCPM depth scale -> the output columns of o and down: (x W^T) * g = x (W * g)^T.
Head sizes (issue 21): GroupQueryAttention's RoPE takes hd % 16 == 0 only, so other sizes rotate q and k with
RotaryEmbedding before it; GroupQueryAttention itself takes hd % 8 == 0 only, so other sizes are zero-padded
per head to the next multiple of 8 (`cache_head_dim`; the cache rows are that wide, manifest `kv_head_dim`).
Gemma 3: post-norms are two more RMSNorms (standard ops, fused on load), GeGLU is FastGelu (the tanh
approximation) * up, the softmax scale is GroupQueryAttention's `scale`; sliding-window layers keep a ring
cache and attend with standard ops (fused_ring.py), full layers keep GroupQueryAttention.
The first RMSNorm is written in standard ops that onnxruntime fuses on load; seed 000's clamped RMSNorm
(rsqrt(max(ms, eps))) has no fused kernel, so that preset's norms stay plain ops.
GPT-2 (nanogpt: no RoPE, LayerNorm, GELU, biases): GroupQueryAttention with do_rotary=0 and no cos/sin caches,
LayerNormalization and SkipLayerNormalization (o's bias in its bias input), MatMul up -> FastGelu (tanh) or
BiasGelu/Gelu (erf) with up's bias inside -> MatMul down (+ bias); the qkv bias as for Qwen2.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from edgellm.layout.kv_fp16 import fp16_cache
from edgellm.layout.lone import EXTRA_ROW, ONE, ROWS_END
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import need
from edgellm.runtime.graphio import SPARE_ROWS, TensorSpec

from .fused_heads import cache_head_dim, pad_heads, rope_in_gqa
from .fused_ring import ring_attention
from .graph_builder import GraphBuilder, to_numpy
from .rewrite import ONNX_TYPES

MS = "com.microsoft"


def _rms_norm(b: GraphBuilder, x: str, weight: str, eps: float, clamp: bool) -> str:
    """RMSNorm over the last axis in standard ops: x / sqrt(mean(x^2) + eps) * w, the pattern onnxruntime fuses
    into its SimplifiedLayerNormalization kernel (which has no ONNX schema at opset 20, so the graph cannot
    name it and still pass the ONNX checker); or seed 000's clamp, max(mean(x^2), eps), which stays unfused."""
    two = b.const(f"{weight}.two", np.array(2.0, np.float32))
    axes = b.const(f"{weight}.axes", np.array([-1], np.int64))
    ms = b.op("ReduceMean", [b.op("Pow", [x, two])[0], axes], keepdims=1)[0]
    floor = b.const(f"{weight}.eps", np.array(eps, np.float32))
    rms = b.op("Sqrt", [b.op("Max" if clamp else "Add", [ms, floor])[0]])[0]
    return b.op("Mul", [b.op("Div", [x, rms])[0], weight])[0]


def rope_tables(model: Decoder, max_seq: int, local: bool = False) -> tuple[np.ndarray, ...]:
    """The RoPE tables a fused layer reads, each [max_seq, hd/2] per frequency (the exporter asks for one more
    position: attention's extra row, graphio.SPARE_ROWS): () without RoPE, (cos, sin), or
    with XPos (q_cos, q_sin, k_cos, k_sin), the per-frequency scales folded in (they commute with the rotation).
    Computed once per export and handed to every layer and variant: two torch calls on the same positions are
    not always bit-identical (Qwen2.5-0.5B, rope_theta 1e6, 256 positions: rows 128+ differed by up to 1.5e-4
    between calls), the variants must hold the same constants to merge into one graph (pairing.py), and equal
    bytes are stored once (rope.data, export/unit.py). `local`: the sliding-window layers' table (Gemma 3)."""
    cfg = model.cfg
    if not cfg.rotary:  # absolute positions, added by the embedding: no rotation in the layers
        return ()
    rotary = model.rotary_local if local else model.rotary
    cos, sin, q_scale, k_scale = rotary(torch.arange(max_seq)[None, :])  # [1,1,M,hd], spread per style

    def per_freq(t: torch.Tensor) -> np.ndarray:
        t = t[0, 0]
        return to_numpy(t[:, : cfg.hd // 2] if cfg.rope_style == "half" else t[:, 0::2])
    if q_scale is None:
        return per_freq(cos), per_freq(sin)
    c, s, qs, ks = per_freq(cos), per_freq(sin), per_freq(q_scale), per_freq(k_scale)
    return c * qs, s * qs, c * ks, s * ks


def build_layer(model: Decoder, layer: int, seq: int, tables: tuple[np.ndarray | None, ...],
                inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                opset: int, ring: bool = False) -> tuple[ir.Model, set[str]]:
    """The fused graph of `model.layers[layer]` at S = `seq`; returns it and its weight initializer names.
    `tables`: `rope_tables(model, max_seq, local)`, the same arrays for every layer and variant. `ring`: the
    layer's cache is a ring (graphio `Dims.ring`: a sliding layer whose window is shorter than max_seq), attended in
    standard ops; a sliding layer whose window covers max_seq is a full one here (GroupQueryAttention, its table),
    and one with a full-length cache (`--sliding-cache full`) too, its window the kernel's `local_window_size`
    where shorter than that cache's max_seq rows (keys with q - p < window: measured equal to the model's mask,
    tests/test_gemma3_covered.py).

    `inputs`/`outputs` are the "inplace" layer contract from `graph_io` (hidden, seqlens_k, total_len,
    past_key.i, past_value.i -> hidden_out, present_key.i, present_value.i).
    """
    cfg, block = model.cfg, model.layers[layer]
    sliding = cfg.window(layer)
    window = sliding if ring else None  # a ring cache is attended with standard ops (fused_ring.py)
    # a full-length cache (max_seq + SPARE_ROWS rows) of a sliding layer: the kernel applies a shorter window
    local_window = sliding if sliding is not None and not ring and sliding < inputs[3].shape[2] - SPARE_ROWS else -1
    h, kv, hd_real = cfg.n_heads, cfg.n_kv_heads, cfg.hd
    hd = cache_head_dim(cfg)  # heads as the graph holds them: zero-padded to it if GroupQueryAttention needs
    need(inputs[3].shape[-1] == hd, f"layer_{layer}: cache rows of {inputs[3].shape[-1]}, expected {hd}")
    clamp = cfg.norm_eps_mode == "clamp"
    p = f"layers.{layer}."
    b = GraphBuilder()
    hidden, seqlens_k, total_len, past_k, past_v = (t.name for t in inputs)
    _, present_k, present_v = (t.name for t in outputs[:3])

    # attention branch: [1,S,D] -> qkv [1,S,(H+2KV)hd]
    x = _first_norm(b, hidden, block.attn_norm, p + "attn_norm", cfg)
    qkv = b.op("MatMul", [x, b.const(p + "attn.qkv.weight", pad_heads(to_numpy(block.attn.qkv.weight).T, hd_real, hd),
                                     True)])[0]
    if cfg.qkv_biased:
        qkv = b.op("Add", [qkv, b.const(p + "attn.qkv.bias", pad_heads(to_numpy(block.attn.qkv.bias), hd_real, hd),
                                        True)])[0]
    rope_outside = cfg.rotary and (not rope_in_gqa(cfg) or window is not None)  # XPos, a head size GQA's RoPE refuses, a ring
    separate = cfg.qk_norm or rope_outside  # q, k, v as three tensors (else GroupQueryAttention takes packed qkv)
    if separate:
        sizes = b.const(p + "qkv.split", np.array([h * hd, kv * hd, kv * hd], np.int64))
        q, k, v = b.op("Split", [qkv, sizes], n_out=3, axis=-1)
    if cfg.qk_norm:  # per-head RMSNorm: [1,S,heads*hd] -> [1,S,heads,hd] -> norm -> back
        for name, heads in (("q", h), ("k", kv)):
            t = q if name == "q" else k
            t = b.op("Reshape", [t, b.const(f"{p}{name}.heads", np.array([1, seq, heads, hd], np.int64))])[0]
            # padded heads: mean over hd of x^2 = (hd/hd_real) * mean over hd_real, so the same norm is eps scaled
            # by hd_real/hd and weights by sqrt(hd_real/hd) (zeros in the padding, which stays zero)
            shrink = hd_real / hd
            w = pad_heads(to_numpy(getattr(block.attn, f"{name}_norm").weight) * np.float32(shrink ** 0.5), hd_real, hd)
            t = _rms_norm(b, t, b.const(f"{p}attn.{name}_norm.weight", w, True), cfg.norm_eps * shrink, clamp)
            t = b.op("Reshape", [t, b.const(f"{p}{name}.flat", np.array([1, seq, heads * hd], np.int64))])[0]
            q, k = (t, k) if name == "q" else (q, t)
    interleaved = int(cfg.rope_style == "interleaved")
    if rope_outside:  # RoPE (with XPos scales, if any) applied here, per tensor; positions start at total_len - S
        start = b.op("Sub", [total_len, b.const(p + "seq", np.array(seq, np.int32))])[0]
        start = b.op("Reshape", [b.op("Cast", [start], to=TensorProto.INT64)[0],
                                 b.const(p + "one", np.array([1], np.int64))])[0]
        if len(tables) == 4:  # XPos: q and k tables, the scales folded in (rope_tables)
            q_tab = (b.const(p + "rope.q_cos", tables[0]), b.const(p + "rope.q_sin", tables[1]))
            k_tab = (b.const(p + "rope.k_cos", tables[2]), b.const(p + "rope.k_sin", tables[3]))
        else:  # one table pair for q and k
            q_tab = k_tab = (b.const(p + "rope.cos", tables[0]), b.const(p + "rope.sin", tables[1]))
        partial = {"rotary_embedding_dim": hd_real} if hd != hd_real else {}  # padded heads: the real part only
        q = b.op("RotaryEmbedding", [q, start, *q_tab], domain=MS, interleaved=interleaved, num_heads=h,
                 **partial)[0]
        k = b.op("RotaryEmbedding", [k, start, *k_tab], domain=MS, interleaved=interleaved, num_heads=kv,
                 **partial)[0]
        rope_in, rotary = ["", ""], 0
    elif cfg.rotary:
        rope_in, rotary = [b.const(p + "rope.cos", tables[0]), b.const(p + "rope.sin", tables[1])], 1
    else:  # absolute positions: GroupQueryAttention without rotation or caches
        rope_in, rotary = [], 0
    qkv_in = [q, k, v] if separate else [qkv, "", ""]
    if window is not None:
        att, new_k, new_v = ring_attention(b, p, q, k, v, past_k, past_v, total_len, h, kv, hd, inputs[3].shape[2],
                                           window, cfg.scale)
    else:
        att, new_k, new_v = _attention(b, p, qkv_in, past_k, past_v, seqlens_k, total_len, rope_in, num_heads=h,
                                       kv_num_heads=kv, scale=float(cfg.scale), do_rotary=rotary,
                                       rotary_interleaved=interleaved,
                                       **({"local_window_size": local_window} if local_window >= 0 else {}))
    # the branch scale goes into o's output columns, or with post-norms (Gemma) into the norm after it
    branch = np.asarray(_branch_scale(block, "ls_attn"), np.float32)
    o_scale = np.float32(1.0) if cfg.post_norms else branch
    o = pad_heads(to_numpy(block.attn.o.weight) * o_scale[..., None], hd_real, hd).T  # [H*hd, D]
    a = b.op("MatMul", [att, b.const(p + "attn.o.weight", np.ascontiguousarray(o), True)])[0]
    if cfg.post_norms:
        a = _rms_norm(b, a, b.const(p + "attn_post_norm.weight", to_numpy(block.attn_post_norm.weight) * branch, True),
                      cfg.norm_eps, clamp)

    o_bias = (b.const(p + "attn.o.bias", to_numpy(block.attn.o.bias) * branch, True) if cfg.linear_bias else None)

    # MLP branch, on the residual stream hidden + a (+ o's bias)
    y, res = _skip_norm(b, a, hidden, o_bias, block.mlp_norm, p + "mlp_norm", cfg)
    if cfg.mlp_kind == "swiglu":
        gu = _linear(b, y, block.mlp.gate_up, p + "mlp.gate_up")
        f = cfg.hidden_dim
        gate, up = b.op("Split", [gu, b.const(p + "gate_up.split", np.array([f, f], np.int64))], n_out=2, axis=-1)
        if cfg.glu_act == "gelu_tanh":  # GeGLU: onnxruntime's FastGelu is the tanh approximation
            act = b.op("FastGelu", [gate], domain=MS)[0]
        else:
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate])[0]])[0]
        act = b.op("Mul", [act, up])[0]
    else:  # GELU with up's bias inside the activation kernel
        up = b.op("MatMul", [y, b.const(p + "mlp.up.weight", to_numpy(block.mlp.up.weight).T, True)])[0]
        bias = [b.const(p + "mlp.up.bias", to_numpy(block.mlp.up.bias), True)] if cfg.linear_bias else []
        if cfg.mlp_kind == "gelu_tanh":  # FastGelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's
            act = b.op("FastGelu", [up, *bias], domain=MS)[0]
        else:
            act = b.op("BiasGelu" if bias else "Gelu", [up, *bias], domain=MS)[0]
    branch = _branch_scale(block, "ls_mlp")
    if cfg.post_norms:  # the scale goes after the post-norm (a norm would undo it on the weights)
        d = b.op("MatMul", [act, b.const(p + "mlp.down.weight", to_numpy(block.mlp.down.weight).T, True)])[0]
        d = _rms_norm(b, d, b.const(p + "mlp_post_norm.weight", to_numpy(block.mlp_post_norm.weight) * branch, True),
                      cfg.norm_eps, clamp)
    else:
        d = b.op("MatMul", [act, b.const(p + "mlp.down.weight", to_numpy(block.mlp.down.weight).T * branch, True)])[0]
        if cfg.linear_bias:
            d = b.op("Add", [d, b.const(p + "mlp.down.bias", to_numpy(block.mlp.down.bias) * branch, True)])[0]
    out = b.op("Add", [res, d])[0]

    # name the graph outputs: rename the producing nodes' outputs
    _rename(b.nodes, {out: outputs[0].name, new_k: present_k, new_v: present_v})
    graph = helper.make_graph(b.nodes, f"layer_{layer}", [_info(t) for t in inputs], [_info(t) for t in outputs],
                              b.inits)
    proto = helper.make_model(graph, ir_version=10, producer_name="edgellm",
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    if inputs[3].dtype == "float16":  # an fp16 cache (--kv-dtype float16): Casts around the attention kernel
        fp16_cache(proto)
    return ir.from_proto(proto), b.weights


def _attention(b: GraphBuilder, p: str, qkv_in: list[str], past_k: str, past_v: str, seqlens_k: str, total_len: str,
               rope_in: list[str], **attrs: int | float) -> list[str]:
    """GroupQueryAttention on the S real rows and one zero row after them: [1, S, *] -> [1, S, H*hd], the cache
    written in place (the zero row's K/V into the spare row after the real ones, graphio.SPARE_ROWS).

    Why the extra row: onnxruntime's CPU kernel computes a lone row (S = 1) in another summation order than the
    same row among several (S >= 2 rows are computed alike: measured bitwise, any past length, both thread
    counts), ~1e-7 in the attention output, which int8 activation rounding can turn into another greedy token.
    With the extra row every call has S >= 2, so a decode step's row equals that row of a speculative
    verification over k + 1 rows, bit for bit (runtime/speculative.py; tests/test_speculative.py). The
    extra row costs one more query row of attention, not a matmul row (but 8-27 % of a decode step: sampled runs
    open the stack without it, edgellm/layout/lone.py). `qkv_in`: [qkv, "", ""] packed or [q, k, v].

    An fp16 cache (manifest kv_dtype float16) is one rewrite of the built graph (`build_layer`,
    edgellm/layout/kv_fp16.py): Casts around the kernel, the rest of the layer fp32. Measured on
    SmolLM2-135M-Instruct against the fp32 cache: KL to the fp32 export 0.0055 -> 0.0056 (int8), decode -1.5 to
    -6 % up to a few hundred tokens of context, +21 % at 1800 (docs/benchmarks.md)."""
    pads = b.const(p + EXTRA_ROW, np.array([0, 0, 0, 0, 1, 0], np.int64))  # [1, S, W] -> [1, S + 1, W]
    padded = [b.op("Pad", [x, pads])[0] for x in qkv_in if x]
    one = b.const(p + ONE, np.array(1, np.int32))
    lengths = [b.op("Add", [seqlens_k, one])[0], b.op("Add", [total_len, one])[0]]
    att, new_k, new_v = b.op("GroupQueryAttention", [*padded, *([""] * (3 - len(padded))), past_k, past_v,
                                                     *lengths, *rope_in], n_out=3, domain=MS, **attrs)
    # drop the extra row: [1, S + 1, H*hd] -> [1, S, H*hd] (ends -1: S-free, so both variants pair)
    starts, ends, axes = (b.const(p + name, np.array([v], np.int64))
                          for name, v in (("attn.rows.start", 0), (ROWS_END, -1), ("attn.rows.axis", 1)))
    return [b.op("Slice", [att, starts, ends, axes])[0], new_k, new_v]


def _first_norm(b: GraphBuilder, x: str, norm: torch.nn.Module, name: str, cfg: ModelConfig) -> str:
    """The attention branch's norm: RMSNorm in fusable standard ops, or LayerNormalization (weight and bias)."""
    w = b.const(name + ".weight", to_numpy(norm.weight), True)
    if cfg.norm_kind == "layer":
        return b.op("LayerNormalization", [x, w, b.const(name + ".bias", to_numpy(norm.bias), True)], axis=-1,
                    epsilon=cfg.norm_eps)[0]
    return _rms_norm(b, x, w, cfg.norm_eps, cfg.norm_eps_mode == "clamp")


def _skip_norm(b: GraphBuilder, a: str, hidden: str, bias: str | None, norm: torch.nn.Module, name: str,
               cfg: ModelConfig) -> tuple[str, str]:
    """(norm(hidden + a + bias), hidden + a + bias): the residual add and the MLP's norm in one kernel (Skip[Simplified]
    LayerNormalization, bias in its bias input), or plain ops for the clamped RMSNorm."""
    w = b.const(name + ".weight", to_numpy(norm.weight), True)
    if cfg.norm_kind == "layer":
        beta = b.const(name + ".bias", to_numpy(norm.bias), True)
        y, _, _, res = b.op("SkipLayerNormalization", [a, hidden, w, beta, *([bias] if bias else [])], n_out=4,
                            domain=MS, epsilon=cfg.norm_eps)
        return y, res
    if bias is not None:
        a = b.op("Add", [a, bias])[0]
    if cfg.norm_eps_mode == "clamp":
        res = b.op("Add", [hidden, a])[0]
        return _rms_norm(b, res, w, cfg.norm_eps, True), res
    y, _, _, res = b.op("SkipSimplifiedLayerNormalization", [a, hidden, w], n_out=4, domain=MS,
                        epsilon=cfg.norm_eps)
    return y, res


def _linear(b: GraphBuilder, x: str, linear: torch.nn.Linear, name: str) -> str:
    """MatMul(x, W^T) (+ bias)."""
    y = b.op("MatMul", [x, b.const(name + ".weight", to_numpy(linear.weight).T, True)])[0]
    if linear.bias is not None:
        y = b.op("Add", [y, b.const(name + ".bias", to_numpy(linear.bias), True)])[0]
    return y


def _branch_scale(block: torch.nn.Module, gamma: str) -> np.ndarray | float:
    """What multiplies a branch's output columns: LayerScale gamma [D] times the depth scale, or 1."""
    cfg = block.cfg
    g = to_numpy(getattr(block, gamma)) if cfg.layerscale_init is not None else np.float32(1.0)
    return (g * np.float32(cfg.residual_scale)).astype(np.float32)


def _rename(nodes: list[onnx.NodeProto], names: dict[str, str]) -> None:
    for node in nodes:
        for j, o in enumerate(node.output):
            if o in names:
                node.output[j] = names[o]
        for j, i in enumerate(node.input):
            if i in names:
                node.input[j] = names[i]


def _info(t: TensorSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, ONNX_TYPES[t.dtype], list(t.shape))
