"""4-bit blocks with offsets (`--block-min`, schemes.Scheme.offsets: llama.cpp Q4_1's layout, w = code * s + m):
the rounding against its definition, the graph against numpy, the grid detection of `--block-min auto`, and a
whole export whose weights lie on a Q4_1 grid quantized back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from edgellm.cli import main
from edgellm.export import ExportOptions, export_model
from edgellm.model import PRESETS
from edgellm.quant.gridfit import fit
from edgellm.quant.grids import own_scheme
from edgellm.quant.methods import QuantSpec, snap_offsets
from edgellm.quant.plan import QuantPlan
from edgellm.quant.rewrite import quantize_model
from edgellm.quant.schemes import Scheme, dequantize, quant_error, quantize
from edgellm.runtime.metrics import kl_divergence
from tests.export_helpers import onnx_generate_logits, tiny_model, torch_logits
from tests.quant_helpers import OPTIONS
from tests.quant_helpers import quantize as quantize_export

MIN = Scheme(4, 32, False, True)


def q4_1_weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    """A weight made of llama.cpp Q4_1 blocks: m + q * d, q = 0..15 spanning the block, d and m fp16."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = rng.uniform(0.001, 0.02, (n, nb, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (n, nb, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, nb, 32))
    q[..., 0], q[..., 1] = 0, 15
    return (m + q * d).reshape(n, k).astype(np.float32)


def test_offsets_round_min_to_max_with_fp16_step_and_minimum() -> None:
    w = np.random.default_rng(2).standard_normal((24, 96)).astype(np.float32)
    qw = quantize(w, MIN)
    blocks = w.reshape(24, 3, 32)
    assert np.array_equal(qw.scales, ((blocks.max(-1) - blocks.min(-1)) / 15).astype(np.float16).astype(np.float32))
    assert np.array_equal(qw.offsets, blocks.min(-1).astype(np.float16).astype(np.float32))
    assert qw.codes.max() == 15 and qw.codes.min() == 0 and not qw.zero_points.any()
    codes = qw.codes.reshape(24, 3, 32).astype(np.float32)
    assert np.array_equal(dequantize(qw), (codes * qw.scales[..., None] + qw.offsets[..., None]).reshape(24, 96))
    # round to nearest: within half a step (plus the fp16 rounding of the minimum) everywhere
    err = np.abs(dequantize(qw) - w).reshape(24, 3, 32).max(-1)
    assert np.all(err <= qw.scales / 2 + np.abs(qw.offsets - blocks.min(-1)) + 1e-6)


def test_a_q4_1_grid_comes_back_exactly_and_is_detected() -> None:
    w = q4_1_weight(16, 128)
    assert np.abs(dequantize(quantize(w, MIN)) - w).max() <= 1e-6 * np.abs(w).max()   # min..max rounding keeps it
    assert own_scheme(w, 32) == MIN and np.array_equal(dequantize(fit(w, MIN)), w)    # and auto finds it
    assert quant_error(w, quantize(w, Scheme(4, 32, True))).rel_rms_err > 0.01      # Q4_0's rule cannot
    assert quant_error(w, quantize(w, Scheme(4, 32, False))).rel_rms_err > 0.01     # nor an integer zero point
    assert fit(w, Scheme(4, 64, False, True)) is None      # a 64-block holds two grids
    assert fit(w, Scheme(4, 32, True)) is None             # not Q4_0's grid
    shifted = w + np.float32(1e-4)      # still a grid (to float32's rounding of the sum), offsets no fp16 values
    assert np.abs(dequantize(fit(shifted, MIN)) - shifted).max() <= 1e-6 * np.abs(w).max()
    assert own_scheme(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), 32) is None


@pytest.mark.parametrize("stored", [("int4", "int8", "int4-min"), ()])
def test_the_graph_adds_the_offsets_term_once_per_activation(stored) -> None:
    """y = MatMulNBits (symmetric codes) + block means of x @ ((m + 8 s) * 32), the term an 8-bit MatMulNBits
    whose grid the offsets were snapped to: at accuracy level 0 the graph computes x @ dequantize(W)^T; two weights
    reading one activation share its block means; fp16 scales (a Cast folded by onnxruntime) or float32."""
    rng = np.random.default_rng(0)
    k = 96
    w1, w2 = rng.standard_normal((40, k)).astype(np.float32), rng.standard_normal((24, k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y1"], name="a"), helper.make_node("MatMul", ["x", "w2"], ["y2"], name="b")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, k])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ("y1", "y2")],
        [numpy_helper.from_array(w1.T.copy(), "w1"), numpy_helper.from_array(w2.T.copy(), "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    plan = QuantPlan(lambda site: QuantSpec(MIN), accuracy_level=0, fp16_scales=True, fp16_stored=stored)
    quantize_model(model, plan)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("AveragePool") == 1 and ops.count("MatMulNBits") == 4 and ops.count("Cast") == (2 if stored else 0)
    assert all(len(n.input) == 3 for n in model.graph.node if n.op_type == "MatMulNBits")   # symmetric: no zp
    assert sorted(a.i for n in model.graph.node for a in n.attribute if a.name == "bits") == [4, 4, 8, 8]
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for y, w in zip(got, (w1, w2), strict=True):
        want = x @ dequantize(snap_offsets(w, quantize(w, MIN))).T
        assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max()
        assert np.abs(want - x @ dequantize(quantize(w, MIN)).T).max() > 1e-5       # the snap moved them
        assert np.abs(want - x @ w.T).max() > 1e-2                       # the rounding is visible at all


@pytest.fixture(scope="module")
def grid_export(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama2 model whose layer linears are snapped onto Q4_1 grids, exported (and its float original)."""
    tmp = tmp_path_factory.mktemp("grid")
    model = tiny_model("llama2", seed=3)
    float_dir, grid_dir = tmp / "float", tmp / "grid"
    export_model(model, float_dir, ExportOptions(granularity="layer", **OPTIONS), progress=False, log=lambda _: None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), MIN))))
    export_model(model, grid_dir, ExportOptions(granularity="layer", **OPTIONS), progress=False, log=lambda _: None)
    return float_dir, grid_dir


def _quantize(src: Path, out: Path, capsys, *flags: str) -> tuple[int, str, dict]:
    code = main(["quantize", str(src), "-o", str(out), "--no-progress", "--no-check", *flags])
    err = capsys.readouterr().err
    return code, err, (json.loads((out / "manifest.json").read_text())["quantization"] if code == 0 else {})


def test_auto_keeps_a_grid_exactly_and_leaves_float_weights_alone(grid_export, tmp_path, capsys) -> None:
    float_dir, grid_dir = grid_export
    code, err, record = _quantize(grid_dir, tmp_path / "grid-int4", capsys, "--bits", "4")
    assert code == 0 and "all 8 linears lie on llama.cpp grids" in err and "8 4-bit with offsets (Q4_1/Q4_K)" in err
    assert (record["options"]["block_min"], record["options"]["method"]) == ("on", "grid")   # not awq: exact
    assert main(["info", str(tmp_path / "grid-int4")]) == 0
    assert ("precision: int4 g32 on their own grids (8 4-bit, 8 of them with block minima; 0 8-bit), format fast"
            in capsys.readouterr().out)
    layers = {n: w for n, w in record["weights"].items() if n.startswith("layers.")}
    assert len(layers) == 8 and all(w["offsets"] and w["rel_rms_err"] < 1e-6 for w in layers.values())
    # the quantized export computes the grid model: its layers add no error, only the int8 head / table does
    code, _, off = _quantize(grid_dir, tmp_path / "grid-off", capsys, "--bits", "4", "--block-min", "off",
                             "--int8-fraction", "0")
    assert code == 0 and all(w["rel_rms_err"] > 0.01 for n, w in off["weights"].items() if n.startswith("layers."))
    prompt = list(range(3, 19))
    ref, _ = onnx_generate_logits(grid_dir, prompt, 0)
    kl = {name: float(kl_divergence(ref, onnx_generate_logits(tmp_path / name, prompt, 0)[0]).mean())
          for name in ("grid-int4", "grid-off")}
    assert kl["grid-int4"] < 0.5 * kl["grid-off"], kl
    # trained-like float weights: no grid, and the --bits 4 profile's settings apply (balanced: k-quant minima)
    code, err, record = _quantize(float_dir, tmp_path / "float-int4", capsys, "--bits", "4")
    assert code == 0 and "--block-min" not in err
    assert (record["options"]["block_min"], record["options"]["method"]) == ("on", "awq")
    assert record["options"]["int8_fraction"] == 0.15 and record["options"]["scales_dtype"] == "float16"
    code, _, record = _quantize(float_dir, tmp_path / "float-min", capsys, "--bits", "4", "--block-min", "on",
                                "--group", "lm_head=0", "--int8-fraction", "0")   # a per-channel head: no offsets
    assert code == 0 and record["options"]["method"] == "awq"
    assert record["weights"]["lm_head.weight"]["block_size"] == 0
    assert all(w["offsets"] for n, w in record["weights"].items() if n.startswith("layers."))


def test_int8_is_awq_on_float_weights_and_rounds_a_grid_to_nearest(grid_export, tmp_path, capsys) -> None:
    """`--bits 8` (AWQ, `--block-min auto`): float weights keep AWQ (calibrated); a model whose linears lie on
    llama.cpp grids is rounded to nearest (AWQ's search moves them off: the grid references' KL is lower with RTN),
    with a line saying so; an explicit --block-min off keeps AWQ there too."""
    float_dir, grid_dir = grid_export
    code, err, record = _quantize(float_dir, tmp_path / "float8", capsys, "--bits", "8")
    assert code == 0 and "--block-min" not in err and record["options"]["method"] == "awq" and record["calibration"]
    code, err, record = _quantize(grid_dir, tmp_path / "grid8", capsys, "--bits", "8")
    assert code == 0 and "int8 rounds them to nearest" in err and record["options"]["method"] == "rtn"
    assert not record.get("calibration")
    code, _, record = _quantize(grid_dir, tmp_path / "grid8-awq", capsys, "--bits", "8", "--block-min", "off")
    assert code == 0 and record["options"]["method"] == "awq"
    # only the first layer's linears on a grid (a float model, fine-tuned from one, say): not a GGUF's, AWQ stays
    model = tiny_model("llama2", seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.0.") and p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), MIN))))
    export_model(model, tmp_path / "part", ExportOptions(granularity="layer", **OPTIONS), progress=False,
                 log=lambda _: None)
    code, err, record = _quantize(tmp_path / "part", tmp_path / "part8", capsys, "--bits", "8")
    assert code == 0 and "--block-min" not in err and record["options"]["method"] == "awq"


def test_block_min_mse_calibrates_and_beats_min_to_max_on_float_weights(grid_export, tmp_path, capsys) -> None:
    """`--block-min on --method mse` on a float export: the record says mse with block minima and calibration, every
    layer weight has offsets, and the model's KL to fp32 is below min..max rounding's (`--method rtn`, which
    needs no calibration) on the same prompt."""
    float_dir = grid_export[0]
    flags = ("--bits", "4", "--block-min", "on", "--lm-head", "fp32", "--embeddings", "fp32", "--int8-fraction", "0")
    code, _, mse = _quantize(float_dir, tmp_path / "mse", capsys, *flags, "--method", "mse")
    assert code == 0 and (mse["options"]["method"], mse["options"]["block_min"]) == ("mse", "on")
    code, _, rtn = _quantize(float_dir, tmp_path / "rtn", capsys, *flags, "--method", "rtn")
    assert code == 0 and mse.get("calibration") and not rtn.get("calibration")
    layers = [n for n in mse["weights"] if n.startswith("layers.")]
    assert len(layers) == 8 and all(mse["weights"][n]["offsets"] for n in layers)
    assert main(["info", str(tmp_path / "mse")]) == 0
    assert "precision: int4 g32 with block minima, k-quant search, format fast" in capsys.readouterr().out
    prompt = list(range(3, 19))
    ref, _ = onnx_generate_logits(float_dir, prompt, 0)
    kl = {name: float(kl_divergence(ref, onnx_generate_logits(tmp_path / name, prompt, 0)[0]).mean())
          for name in ("mse", "rtn")}
    assert kl["mse"] < kl["rtn"], kl


@pytest.mark.parametrize(("flags", "message"), [
    (["--bits", "4", "--block-min", "on", "--method", "gptq"], "--block-min on: each block's min..max (rtn)"),
    (["--bits", "8", "--block-min", "on"], "--block-min on: only with --bits 4"),
    (["--bits", "4", "--block-min", "on", "--asymmetric"], "--block-min on: only with --bits 4"),
    (["--bits", "4", "--block-min", "on", "--format", "portable"], "--block-min on: only with --bits 4"),
    (["--bits", "4", "--block-min", "on", "--group-size", "0"], "--block-min on: needs blocks"),
    (["--bits", "4", "--block-min", "on", "--group", "layers.0.*=0"], "--group layers.0.*=0: layers.0.attn.qkv has"),
    (["--bits", "4", "--block-min", "yes"], "--block-min: invalid choice"),
])
def test_block_min_errors_are_one_line(grid_export, tmp_path, capsys, flags: list[str], message: str) -> None:
    out = tmp_path / "q"
    code = main(["quantize", str(grid_export[1]), "-o", str(out), "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_onnx_graph_is_valid_after_offsets(grid_export, tmp_path, capsys) -> None:
    """The paired layer graphs and the stack pass onnx's checker (ops, types and opsets as declared)."""
    code, _, _ = _quantize(grid_export[1], tmp_path / "q", capsys, "--bits", "4")
    assert code == 0
    for path in (tmp_path / "q").glob("*.onnx"):
        onnx.checker.check_model(str(path))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_offset_terms_are_mapped_and_leave_the_rss(grid_export, tmp_path) -> None:
    """A grid kept exactly (`auto`) stores its offsets' float term (m + 8 s) and the scales float32; searched
    offsets (`on`) an 8-bit MatMulNBits term. The runtime hands both to the pre-packed stack from its own maps and
    drops their pages once packed (SmolLM2-135M: 25 MB less RSS once open than fp16 + Casts); float16 storage
    folds to the same float32 values: the same logits, bit for bit."""
    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig
    from tests.quant_helpers import mapped_kb

    auto = quantize_export(grid_export[1], tmp_path / "auto", bits=4, keep_grids=True)
    half = quantize_export(grid_export[1], tmp_path / "half", bits=4, keep_grids=True, scales_dtype="float16")
    on = quantize_export(grid_export[1], tmp_path / "on", bits=4, block_min="on")
    def terms(d: Path) -> tuple[set[str], set[str]]:
        nodes = onnx.load(str(d / "stack.onnx"), load_external_data=False).graph.node
        return ({n.input[1] for n in nodes if n.op_type == "MatMul"},
                {n.input[2] for n in nodes if n.op_type == "MatMulNBits" and ("bits", 8) in
                 {(a.name, a.i) for a in n.attribute}})
    (floats, eights), (none, searched) = terms(auto), terms(on)
    assert len(floats) >= 4 and len(floats | eights) == 8 and not none and len(searched) == 8
    offsets = floats | eights    # a float term's weights, an 8-bit one's scales (its codes: packed, dropped)
    engines = [Generator.open(d, config=SessionConfig(threads=1)).engine for d in (auto, half, on)]
    prompt = list(range(1, 12))
    assert np.array_equal(engines[0].forward(prompt), engines[1].forward(prompt))
    for t in (5, 9, 200):
        assert np.array_equal(engines[0].forward([t]), engines[1].forward([t]))
    for engine, names in ((engines[0], offsets), (engines[2], searched)):
        place = engine.placement[f"{engine.stack_role}.decode"]
        assert names <= place.mapped and place.packed_files
        assert all(mapped_kb(f) == 0 for f in place.packed_files), place.packed_files


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_computes_its_dequantized_model(preset: str, tmp_path) -> None:
    """At accuracy level 1 (fp32 activations) an export quantized with block minima on its layer linears only
    computes the PyTorch model whose layer weights are dequantize(snap_offsets(quantize(W))): logits within 1e-4 of it (every
    preset's linears, fused or not, biased or not). The layer graphs fold LayerScale and MiniCPM's depth scale into
    o and down, which fp16-rounded block minima do not commute with: those presets export whole models."""
    import copy

    model = tiny_model(preset, seed=3)
    src = tmp_path / "fp32"
    granularity = "model" if preset in ("stellarbyte", "minicpm4") else "layer"
    export_model(model, src, ExportOptions(granularity=granularity, **OPTIONS), progress=False, log=lambda _: None)
    out = quantize_export(src, tmp_path / "min", bits=4, block_min="on", accuracy_level=1, lm_head="fp32",
                          embeddings="fp32")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(snap_offsets(p.numpy(), quantize(p.numpy(), MIN)))))
    tokens = list(range(3, 22))
    got, _ = onnx_generate_logits(out, tokens, 0)
    want = torch_logits(ref, tokens)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), preset
    assert np.abs(want - torch_logits(model, tokens)).max() > 1e-3                  # the rounding shows


def test_a_q4_0_grid_is_kept_without_offsets_and_awq_keeps_it_too(tmp_path, capsys) -> None:
    """Weights on Q4_0's grid (a model converted from a Q4_0 GGUF) need no offsets: `auto` keeps them on their
    symmetric grid (block minima off); AWQ (`--block-min off`: a scale migration of 0 and a clip ratio of 1 are
    in its search, and give error 0) gives every layer weight back exactly too."""
    from edgellm.quant.schemes import with_fp16_scales

    model = tiny_model("llama2", seed=3)
    sym = Scheme(4, 32, True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                w = p.numpy()
                p.copy_(torch.from_numpy(dequantize(with_fp16_scales(w, quantize(w, sym)))))
                assert own_scheme(p.numpy(), 32) == sym
    src = tmp_path / "q4_0"
    export_model(model, src, ExportOptions(granularity="layer", **OPTIONS), progress=False, log=lambda _: None)
    code, err, record = _quantize(src, tmp_path / "int4", capsys, "--bits", "4")
    assert code == 0 and "8 4-bit symmetric (Q4_0)" in err
    assert (record["options"]["block_min"], record["options"]["method"]) == ("off", "grid")
    layers = [w for n, w in record["weights"].items() if n.startswith("layers.")]
    assert len(layers) == 8 and all(not w["offsets"] and w["rel_rms_err"] < 1e-6 for w in layers)
    code, err, record = _quantize(src, tmp_path / "awq", capsys, "--bits", "4", "--block-min", "off",
                                  "--profile", "small")
    assert code == 0 and "--block-min auto" not in err
    assert (record["options"]["block_min"], record["options"]["method"]) == ("off", "awq")
    layers = [w for n, w in record["weights"].items() if n.startswith("layers.")]
    assert len(layers) == 8 and all(not w["offsets"] and w["rel_rms_err"] < 1e-6 for w in layers)


def test_kl_budget_climbs_to_block_minima_on_a_grid(grid_export, tmp_path, capsys) -> None:
    """--kl-budget resolves --block-min auto rung by rung: on a Q4_1 grid the g64 rung (no grid at 64) is AWQ's and
    misses a tight budget, the g32 rung keeps the grid with block minima and is kept."""
    code = main(["quantize", str(grid_export[1]), "-o", str(tmp_path / "b"), "--bits", "4", "--kl-budget", "0.01",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "--kl-budget 0.01: int4-g64" in out and "int4-g32" in out
    record = json.loads((tmp_path / "b" / "manifest.json").read_text())["quantization"]
    layers = [w for n, w in record["weights"].items() if n.startswith("layers.")]
    assert record["options"]["block_min"] == "on" and all(w["offsets"] and w["rel_rms_err"] < 1e-6 for w in layers)
