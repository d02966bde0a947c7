"""The ONNX rewrite: onnxruntime must compute exactly x @ dequantize(Wq), which proves the packing is
what its kernels read. Graphs are built by hand (IR 10, explicit opsets)."""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgellm.quant.methods import quantize_weight
from edgellm.quant.rewrite import QuantPlan, QuantSpec, by_pattern, quantize_model
from edgellm.quant.schemes import Scheme, dequantize, quant_error
from edgellm.runtime.errors import EdgeError

S = 5


def matmul_model(ws: dict[str, np.ndarray], opset: int = 21, chain: bool = False) -> onnx.ModelProto:
    """x [1,S,K] @ each W [K,N] initializer; `chain` feeds each output into the next MatMul."""
    nodes, inits, cur = [], [], "x"
    k = next(iter(ws.values())).shape[0]
    outs = []
    for i, (name, w) in enumerate(ws.items()):
        out = f"y{i}"
        nodes.append(helper.make_node("MatMul", [cur if chain else "x", name], [out], name=f"mm{i}"))
        inits.append(numpy_helper.from_array(w, name))
        cur = out
        outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, S, w.shape[1]]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, k])],
                              outs[-1:] if chain else outs, inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, feeds: dict, optimize: bool = True, qdq_level: str = "1") -> list[np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", qdq_level)
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def plan(scheme: Scheme, fmt: str, method: str = "rtn", level: int = 0) -> QuantPlan:
    return QuantPlan(by_pattern(QuantSpec(scheme, method)), fmt, accuracy_level=level)


CASES = [(bits, sym, g, k) for bits in (4, 8) for sym in (True, False) for g in (32, 64, 128)
         for k in (64, 100, 288)]


@pytest.mark.parametrize(("bits", "sym", "group", "k"), CASES)
def test_matmulnbits_computes_x_times_dequantized_weight(bits: int, sym: bool, group: int, k: int) -> None:
    rng = np.random.default_rng(k + group + bits)
    w = rng.standard_normal((k, 48)).astype(np.float32)
    x = rng.standard_normal((1, S, k)).astype(np.float32)
    model = matmul_model({"w": w}, opset=20 if k == 100 else 21)
    scheme = Scheme(bits, group, sym)
    reports = quantize_model(model, plan(scheme, "fast"))
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    assert "w" not in {t.name for t in model.graph.initializer}
    expected = x @ dequantize(quantize_weight(w.T, scheme)).T
    assert rel(run(model, {"x": x})[0], expected) < 1e-4
    (r,) = reports
    assert r.shape == (48, k) and r.scheme == f"{scheme.label}-rtn" and r.bytes_before == w.nbytes
    assert r.max_abs_err == pytest.approx(quant_error(w.T, quantize_weight(w.T, scheme)).max_abs_err)


@pytest.mark.parametrize(("bits", "sym", "group", "k"),
                         [c for c in CASES if c[2] != 64] + [(8, True, 0, 288), (8, False, 0, 100), (4, True, 0, 64)])
def test_portable_dequantize_linear_matmul(bits: int, sym: bool, group: int, k: int) -> None:
    rng = np.random.default_rng(k + group + bits + 1)
    w = rng.standard_normal((k, 40)).astype(np.float32)
    x = rng.standard_normal((1, S, k)).astype(np.float32)
    model = matmul_model({"w": w}, opset=20)
    scheme = Scheme(bits, group, sym)
    quantize_model(model, plan(scheme, "portable"))
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    assert model.ir_version == 10
    assert model.opset_import[0].version == (21 if bits == 4 or group else 20)
    expected = x @ dequantize(quantize_weight(w.T, scheme)).T
    assert rel(run(model, {"x": x}, optimize=False)[0], expected) < 1e-4      # the DequantizeLinear op itself
    assert rel(run(model, {"x": x})[0], expected) < 1e-4                      # onnxruntime's fused form


def test_wrong_packing_would_be_caught() -> None:
    """Control: swapping the nibbles of B changes the result, so the exactness checks above can fail."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    x = rng.standard_normal((1, S, 64)).astype(np.float32)
    model = matmul_model({"w": w})
    quantize_model(model, plan(Scheme(4, 32, True), "fast"))
    good = run(model, {"x": x})[0]
    b = next(t for t in model.graph.initializer if t.name == "w.q")
    packed = numpy_helper.to_array(b)
    b.CopyFrom(numpy_helper.from_array(((packed >> 4) | (packed << 4)).astype(np.uint8), "w.q"))
    assert rel(run(model, {"x": x})[0], good) > 0.05


def test_per_channel_int8_fast_keeps_per_channel_numerics() -> None:
    rng = np.random.default_rng(8)
    w = rng.standard_normal((300, 24)).astype(np.float32)
    x = rng.standard_normal((1, S, 300)).astype(np.float32)
    model = matmul_model({"w": w})
    quantize_model(model, plan(Scheme(8, 0, True), "fast", method="mse"))
    node = model.graph.node[0]
    assert {a.name: a.i for a in node.attribute}["block_size"] == 256
    expected = x @ dequantize(quantize_weight(w.T, Scheme(8, 0, True), "mse")).T
    assert rel(run(model, {"x": x})[0], expected) < 1e-4


@pytest.mark.parametrize("fmt", ["fast", "portable"])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_with_bias(fmt: str, trans_b: int) -> None:
    rng = np.random.default_rng(9)
    w = rng.standard_normal((32, 64)).astype(np.float32)       # [N, K]
    bias = rng.standard_normal(32).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="fc", transB=trans_b)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 32])],
                              [numpy_helper.from_array(w if trans_b else w.T.copy(), "w"),
                               numpy_helper.from_array(bias, "c")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    (r,) = quantize_model(model, plan(Scheme(4, 32, False), fmt))
    assert r.op == "Gemm" and r.shape == (32, 64) and r.module == ""
    expected = x @ dequantize(quantize_weight(w, Scheme(4, 32, False))).T + bias
    assert rel(run(model, {"x": x})[0], expected) < 1e-4


def test_plan_mixes_precisions_and_shares_weights() -> None:
    rng = np.random.default_rng(10)
    ws = {name: rng.standard_normal((64, 64)).astype(np.float32) * 0.1
          for name in ("layers.0.mlp.weight", "layers.1.mlp.weight", "lm_head.weight")}
    model = matmul_model(ws, chain=True)
    extra = helper.make_node("MatMul", ["x", "layers.1.mlp.weight"], ["y_shared"], name="shared")
    model.graph.node.append(extra)                             # a second consumer of one weight
    model.graph.output.append(helper.make_tensor_value_info("y_shared", TensorProto.FLOAT, [1, S, 64]))
    x = rng.standard_normal((1, S, 64)).astype(np.float32)
    int4, int8 = QuantSpec(Scheme(4, 32, True)), QuantSpec(Scheme(8, 0, True))
    choose = by_pattern(int4, [("lm_head", int8), ("layers.0.*", None)])
    reports = quantize_model(model, QuantPlan(choose, "fast", accuracy_level=0))
    by_name = {r.name: r for r in reports}
    assert by_name["layers.0.mlp.weight"].scheme == "fp32"
    assert by_name["layers.1.mlp.weight"].scheme == "int4-g32-sym-rtn"
    assert by_name["lm_head.weight"].scheme == "int8-ch-sym-rtn" and by_name["lm_head.weight"].module == "lm_head"
    assert by_name["layers.1.mlp.weight"].bytes_after == 64 * 2 * 16 + 64 * 2 * 4   # codes + fp32 scales
    inits = {t.name for t in model.graph.initializer}
    assert inits == {"layers.0.mlp.weight", "layers.1.mlp.weight.q", "layers.1.mlp.weight.scales",
                     "lm_head.weight.q", "lm_head.weight.scales"}
    assert [n.op_type for n in model.graph.node] == ["MatMul", "MatMulNBits", "MatMulNBits", "MatMulNBits"]
    deq = {n: dequantize(quantize_weight(w.T, s.scheme)).T for (n, w), s in zip(list(ws.items())[1:], (int4, int8), strict=True)}
    h = x @ ws["layers.0.mlp.weight"]
    want = (h @ deq["layers.1.mlp.weight"]) @ deq["lm_head.weight"]
    got, shared = run(model, {"x": x})
    assert rel(got, want) < 1e-4 and rel(shared, x @ deq["layers.1.mlp.weight"]) < 1e-4


@pytest.mark.parametrize("sym", [True, False])
def test_gather_embedding_int8_per_row(sym: bool) -> None:
    rng = np.random.default_rng(11)
    table = rng.standard_normal((50, 24)).astype(np.float32)
    ids = np.array([[3, 0, 49, 3, 17]], np.int64)
    node = helper.make_node("Gather", ["embed.weight", "tokens"], ["hidden"], name="embed", axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, S])],
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, S, 24])],
                              [numpy_helper.from_array(table, "embed.weight")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    spec = QuantSpec(Scheme(8, 0, sym))
    (r,) = quantize_model(model, QuantPlan(by_pattern(None, embed=spec)))
    assert r.op == "Gather" and r.scheme == spec.label and r.bytes_after == 50 * 24 + 50 * 4 + (0 if sym else 50)
    assert "embed.weight" not in {t.name for t in model.graph.initializer}
    expected = dequantize(quantize_weight(table, Scheme(8, 0, sym)))[ids]
    assert np.abs(run(model, {"tokens": ids})[0] - expected).max() <= 1e-6
    with pytest.raises(EdgeError, match="int8 per-row"):
        quantize_model(_gather_only(table, "tok_embeddings"), QuantPlan(by_pattern(None, embed=QuantSpec(Scheme(4, 32)))))
    other = _gather_only(table, "rope.cos")                 # not an embedding: the default plan keeps it
    (r,) = quantize_model(other, QuantPlan(by_pattern(None, embed=spec)))
    assert r.scheme == "fp32" and [n.op_type for n in other.graph.node] == ["Gather"]


def _gather_only(table: np.ndarray, name: str) -> onnx.ModelProto:
    node = helper.make_node("Gather", [name, "t"], ["h"], axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("t", TensorProto.INT64, [1, S])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, S, 24])],
                              [numpy_helper.from_array(table, name)])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])


def test_accuracy_levels_time_and_agree() -> None:
    """Measures (prints) MatMulNBits decode latency per accuracy_level; asserts only that level 4 (int8
    activations) stays close to the exact level-0 result. Run with -s to see the numbers."""
    rng = np.random.default_rng(12)
    w = rng.standard_normal((768, 2048)).astype(np.float32) * 0.02
    x = rng.standard_normal((1, 1, 768)).astype(np.float32)
    for scheme in (Scheme(4, 32, True), Scheme(8, 32, True)):
        outs, times = {}, {}
        for level in (0, 1, 4):
            model = matmul_model({"w": w})
            model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 1
            model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 1
            quantize_model(model, plan(scheme, "fast", level=level))
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            outs[level] = sess.run(None, {"x": x})[0]
            reps = 5 if scheme.bits == 8 and level < 4 else 50      # x86 has no fp32-activation int8 kernel
            t0 = time.perf_counter()
            for _ in range(reps):
                sess.run(None, {"x": x})
            times[level] = (time.perf_counter() - t0) / reps * 1e6
        print(f"\n{scheme.label} [1,1,768]x[768,2048] 1 thread: " + ", ".join(
            f"level {lv}: {t:.0f} us" for lv, t in times.items()))
        assert rel(outs[1], outs[0]) < 1e-5
        assert rel(outs[4], outs[0]) < 5e-2


def test_sites_carry_torch_module_paths_and_act_scales_reach_the_search() -> None:
    rng = np.random.default_rng(13)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    act = np.exp(rng.standard_normal(64)).astype(np.float32)
    x = rng.standard_normal((1, S, 64)).astype(np.float32)
    model = matmul_model({"val_3": w})
    prop = model.graph.node[0].metadata_props.add()
    prop.key, prop.value = "pkg.torch.onnx.name_scopes", "['', 'layers.2', 'layers.2.mlp.down', 'linear']"
    seen = []
    spec = QuantSpec(Scheme(4, 32, True), "mse")
    choose = by_pattern(None, [("layers.2.mlp.*", spec)])
    quantize_model(model, QuantPlan(lambda site: seen.append(site) or choose(site), accuracy_level=0,
                                    act_scales={"val_3": act}))
    assert [(s.name, s.module, s.op, s.shape) for s in seen] == [("val_3", "layers.2.mlp.down", "MatMul", (32, 64))]
    aware = dequantize(quantize_weight(w.T, spec.scheme, "mse", act))
    assert not np.array_equal(aware, dequantize(quantize_weight(w.T, spec.scheme, "mse")))
    assert rel(run(model, {"x": x})[0], x @ aware.T) < 1e-4


def _tiny(name: str, inputs: list[str], output: str, scale: float, const: str = "c") -> onnx.ModelProto:
    """y = (x + c) * scale with a constant named `const`: the same name, other content, in every graph."""
    nodes = [helper.make_node("Add", [inputs[0], const], ["t"]), helper.make_node("Mul", ["t", "s"], [output])]
    inits = [numpy_helper.from_array(np.full(4, scale, np.float32), const),
             numpy_helper.from_array(np.array(scale, np.float32), "s")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(i, TensorProto.FLOAT, [1, 4])
                                            for i in inputs],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def test_stacking_keeps_each_graphs_constants_apart() -> None:
    """stack_graphs renames values per unit and any initializer whose name another unit uses with other
    content, so the stack computes exactly the chain of its graphs (here each graph's "c" and "s" differ)."""
    from edgellm.layout.stacking import stack_graphs

    embed = _tiny("embed", ["tokens"], "hidden", 2.0)
    layers = [_tiny(f"layer_{i}", ["hidden", "seqlens_k"], "hidden_out", 3.0 + i) for i in range(3)]
    for i, m in enumerate(layers):  # a per-layer graph output that keeps its name in the stack
        m.graph.node.append(helper.make_node("Identity", ["t"], [f"present_key.{i}"]))
        m.graph.output.append(helper.make_tensor_value_info(f"present_key.{i}", TensorProto.FLOAT, [1, 4]))
    stack = stack_graphs(embed, layers)
    onnx.checker.check_model(stack)
    assert [i.name for i in stack.graph.input] == ["tokens", "seqlens_k"]
    assert [o.name for o in stack.graph.output] == ["hidden_out", "present_key.0", "present_key.1", "present_key.2"]
    x, lens = np.arange(4, dtype=np.float32)[None], np.ones((1, 4), np.float32)
    run = lambda m, feeds: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, feeds)
    want = [run(embed, {"tokens": x})[0]]
    presents = []
    for m in layers:
        out, present = run(m, {"hidden": want[-1], "seqlens_k": lens})
        want.append(out)
        presents.append(present)
    got = run(stack, {"tokens": x, "seqlens_k": lens})
    np.testing.assert_array_equal(got[0], want[-1])
    for g, w in zip(got[1:], presents, strict=True):
        np.testing.assert_array_equal(g, w)
