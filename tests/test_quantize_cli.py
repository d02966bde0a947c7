"""`edgellm quantize`: whole exports in, new exports out, run in onnxruntime against two references.

1. Exactness: at accuracy level 1 (fp32 activations; for the portable format the session config
   `session.qdq_matmulnbits_accuracy_level` = 1, because onnxruntime fuses DequantizeLinear -> MatMul into
   MatMulNBits at that level) a quantized export must compute the PyTorch model whose weights are replaced
   by `dequantize(quantize(W))` from schemes.py: logits within 1e-4 (measured <= 2.2e-6) and the same
   greedy tokens (prefill in chunks + decode steps). This proves every graph rewrite, the tied table and
   the data-file layout.
2. Quality vs fp32 at the default level 4 (int8 activations): relative RMS of the logit error (over the
   vocabulary-centred fp32 logits) <= 5% for int8 and <= 35% for int4 g32, teacher-forced top-1 agreement
   >= 85% (int8) / 50% (int4). Loose on purpose: these are random tiny models whose logits are nearly tied
   (measured worst cases 2.9% / 24%, 90% / 63%); real-weight quality is test_quant_quality.py's job.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edgellm.cli import main
from edgellm.model import PRESETS, Decoder
from edgellm.quant.awq import apply_group, find_groups
from edgellm.quant.methods import quantize_weight
from edgellm.quant.options import INT8_GROUP
from edgellm.quant.schemes import Scheme, dequantize, with_fp16_scales
from edgellm.runtime.kvcache import step_feeds
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.onnxmeta import external_tensors
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import onnx_generate_logits, torch_logits
from tests.quant_helpers import export, quantize

PROMPT = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(7)).tolist()  # 2 chunks + 3
STEPS = 16
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Decoder, Path]:
    """from-scratch: tied embeddings (the table lives in head.data), interleaved RoPE, layer graphs."""
    return export(tmp_path_factory.mktemp("tied"), "from-scratch", "layer")


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Decoder, Path]:
    return export(tmp_path_factory.mktemp("untied"), "llama2", "model")


def generate(directory: Path, tokens: list[int], steps: int, qdq_level: int | None = None) -> tuple[np.ndarray, list[int]]:
    """export_helpers.onnx_generate_logits with a session config: logits [T + steps, V], greedy tokens."""
    entries = (("session.qdq_matmulnbits_accuracy_level", str(qdq_level)),) if qdq_level is not None else ()
    return onnx_generate_logits(directory, tokens, steps, SessionConfig(stack=False, entries=entries))


def dequantized(model: Decoder, bits: int, group: int, symmetric: bool, fp16: bool = True) -> Decoder:
    """The PyTorch model a quantized export with `--lm-head int8` must compute: linears at (bits, group),
    lm_head int8 at INT8_GROUP (--bits 4) or the linears' group (--bits 8), one table when tied, an untied
    embedding int8 per row, every weight dequantize(quantize(W)) (RTN, fp16 scales); a
    position table stays fp32."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())                   # a tied lm_head is not listed twice
    head = Scheme(8, INT8_GROUP if bits == 4 else group, symmetric)
    with torch.no_grad():
        for name, p in params.items():
            if p.dim() != 2 or name == "pos_embed.weight":  # a position table (nanogpt) stays fp32
                continue
            tied_head = name == "lm_head.weight" or (name == "embed.weight" and "lm_head.weight" not in params)
            scheme = Scheme(bits, group, symmetric) if name.startswith("layers.") else (
                head if tied_head else Scheme(8, 0, symmetric))
            w = p.numpy()
            qw = quantize_weight(w, scheme)
            p.copy_(torch.from_numpy(dequantize(with_fp16_scales(w, qw) if fp16 else qw)))
    return ref


def quality(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(relative RMS logit error, teacher-forced top-1 agreement)."""
    centred = want - want.mean(-1, keepdims=True)
    rel = float(np.sqrt(((got - want) ** 2).mean() / (centred ** 2).mean()))
    return rel, float((got.argmax(-1) == want.argmax(-1)).mean())


BOUNDS = {8: (0.05, 0.85), 4: (0.35, 0.5)}
# (bits, group, format, symmetric); group 128 > K = 64 exercises the single-block shrink (plan.nbits)
VARIANTS = [(8, 0, "fast", True), (8, 0, "portable", True), (4, 32, "fast", True), (4, 32, "portable", False),
            (4, 128, "fast", False)]


def check_variants(model: Decoder, src: Path, tmp: Path, fp16: bool = True) -> None:
    """fp16: the exact variants round scales to fp16 (the default) or keep fp32 (presets whose exporter folds
    a constant into a weight, e.g. MiniCPM's logit scale: fp16 rounding does not commute with it, ~1e-3)."""
    _, fp32_tokens = generate(src, PROMPT, STEPS)
    tokens = PROMPT + fp32_tokens
    fp32 = torch_logits(model, tokens)
    greedy: dict[tuple, list[int]] = {}
    for bits, group, fmt, sym in VARIANTS:
        exact = quantize(src, tmp / f"{bits}-{group}-{fmt}-exact", bits=bits, group_size=group, format=fmt,
                         symmetric=sym, accuracy_level=1 if fmt == "fast" else 4, lm_head="int8", fp16_scales=fp16)
        m = read_manifest(exact)     # fast exports pair each in-place layer's variants in one graph
        assert {g.paired for g in m.graphs if g.role == "layer"} <= {fmt == "fast" and m.kv_layout == "inplace"}
        got, new = generate(exact, PROMPT, STEPS, qdq_level=1)
        want = torch_logits(dequantized(model, bits, group, sym, fp16), PROMPT + new)
        assert np.abs(got - want).max() < 1e-4, (bits, fmt)
        assert want[len(PROMPT) - 1:-1].argmax(-1).tolist() == new, (bits, fmt)   # same greedy tokens
        greedy[(bits, fmt)] = new
        default = quantize(src, tmp / f"{bits}-{group}-{fmt}", bits=bits, group_size=group, format=fmt,
                           symmetric=sym)
        got, _ = generate(default, tokens, 0)
        rel, top1 = quality(got, fp32)
        assert rel <= BOUNDS[bits][0] and top1 >= BOUNDS[bits][1], (bits, fmt, rel, top1)
    # fast and portable int8 at matching accuracy levels: the same greedy tokens
    assert greedy[(8, "fast")] == greedy[(8, "portable")]


def test_quantized_exports_compute_the_dequantized_model(tied, untied, tmp_path) -> None:
    for model, src in (tied, untied):
        check_variants(model, src, tmp_path / src.name)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in ("from-scratch", "llama2")])
def test_every_preset(preset: str, tmp_path) -> None:
    granularity = "model" if preset in ("stellarbyte", "qwen2", "mistral") else "layer"
    model, src = export(tmp_path, preset, granularity)
    check_variants(model, src, tmp_path / "q", fp16=False)


def tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_manifest_layout_sizes_and_untouched_input(tied, tmp_path) -> None:
    _, src = tied
    before = tree_hash(src)
    out4 = quantize(src, tmp_path / "q4", bits=4, method="awq", calibration_tokens=64, lm_head="int8")
    out8 = quantize(src, tmp_path / "q8", bits=8)
    assert tree_hash(src) == before                                  # the input export is only read
    fp32, m4, m8 = read_manifest(src), read_manifest(out4), read_manifest(out8)   # sha256 of every file
    for m in (m4, m8):    # fast exports of in-place layers: each layer's variants in one paired graph
        assert [(g.name, g.inputs, g.outputs) for g in m.graphs] == [(g.name, g.inputs, g.outputs)
                                                                     for g in fp32.graphs]
        # ... and the embedding + every layer once more as the stack graph, paired in stack.onnx
        stack = [g for g in m.graphs if g.role == "stack"]
        assert [(g.name, g.file, g.data, g.paired) for g in stack] == [
            ("stack.prefill", "stack.onnx", None, True), ("stack.decode", "stack.onnx", None, True)]
        layers = [g for g in m.graphs if g.role == "layer"]
        assert all(g.paired and g.file == f"layer_{g.layer}.onnx" for g in layers)
        # the head too (format 9: one session runs a speculative verification's k + 1 rows); the embedding not
        assert all(g.paired and g.file == "head.onnx" for g in m.graphs if g.role == "head")
        assert not any(g.paired for g in m.graphs if g.role not in ("layer", "stack", "stack_lone", "head"))
        assert not list(out4.glob("layer_*.prefill.onnx")) and not list(out4.glob("layer_*.decode.onnx"))
    weights = m4.quantization["weights"]
    expected = {f"layers.{i}.{lin}.weight" for i in range(2) for lin in LINEARS} | {"embed.weight", "lm_head.weight"}
    assert set(weights) == expected
    for name, w in weights.items():
        assert {"bits", "block_size", "symmetric", "method", "format", "max_abs_err", "rel_rms_err"} <= set(w)
        if name.startswith("layers."):
            assert (w["bits"], w["block_size"], w["symmetric"], w["method"]) == (4, 32, True, "awq")
            assert name.endswith("attn.o.weight") or 0.0 <= w["awq_alpha"] <= 1.0    # o: no migration (V rows)
            assert 0 < w["rel_rms_err"] < 0.15 and w["bytes_after"] <= 0.16 * w["bytes_before"]
    assert (weights["lm_head.weight"]["bits"], weights["embed.weight"]["shared_with"]) == (8, "lm_head")
    assert m4.quantization["calibration"]["tokens"] >= 64
    for name, w in m8.quantization["weights"].items():
        if name.startswith("layers."):
            assert w["bits"] == 8 and w["bytes_after"] <= 0.27 * w["bytes_before"], name
    # prefill and decode point into one data file, at the same offsets; the tied table is in head.data once
    for m, out in ((m4, out4), (m8, out8)):
        by_stem: dict[str, set] = {}
        for g in m.graphs:
            refs = {(t.location, t.offset, t.length) for t in external_tensors(out / g.file)}
            if g.role in ("stack", "stack_lone"):  # read the embed and layer weights where they are: no byte twice
                layered = {r for h in m.graphs if h.role in ("embed", "layer")
                           for r in {(t.location, t.offset, t.length) for t in external_tensors(out / h.file)}}
                assert refs == layered
                continue
            # a layer also reads the one copy of the RoPE tables, rope.data (copied as it is from the fp32 export)
            assert {loc for loc, _, _ in refs} == {g.data} | ({"rope.data"} if g.role == "layer" else set())
            by_stem.setdefault(g.name.split(".")[0], []).append(refs)
        assert all(refs[0] == refs[1] for refs in by_stem.values())
        assert m.graph("embed", 1).data == "head.data" and not (out / "embed.data").exists()
        table = 256 * 64 + 256 * 4                                  # int8 codes + a scale per row
        assert table <= (out / "head.data").stat().st_size < table + 2 * 4096


def ops(path: Path) -> dict[str, list]:
    """op type -> [bits attribute or initializer dtype of the weight input] per node of interest (a paired
    layer graph, `layer_i.onnx`, for its decode variant)."""
    if not path.exists() and path.name.endswith(".decode.onnx"):
        path = path.with_name(path.name.replace(".decode.onnx", ".onnx"))
    model = onnx.load(path, load_external_data=False)
    inits = {t.name: t.data_type for t in model.graph.initializer}
    nodes = list(model.graph.node)
    found: dict[str, list] = {}
    for n in nodes:
        if n.op_type == "MatMulNBits":
            found.setdefault("MatMulNBits", []).append(next(a.i for a in n.attribute if a.name == "bits"))
        elif n.op_type in ("MatMul", "Gather") and (n.input[0] in inits or n.input[1] in inits):
            found.setdefault(n.op_type, []).append(inits.get(n.input[1], inits.get(n.input[0])))
    return found


def test_mixed_precision_flags_reach_the_graphs(tied, tmp_path) -> None:
    model, src = tied
    out = quantize(src, tmp_path / "mixed", bits=4, keep=("layers.0.*",), int8_layers=(-1,), lm_head="int4",
                   embeddings="fp32")
    assert "MatMulNBits" not in ops(out / "layer_0.decode.onnx")
    assert ops(out / "layer_0.decode.onnx")["MatMul"] == [onnx.TensorProto.FLOAT] * 4
    assert ops(out / "layer_1.decode.onnx")["MatMulNBits"] == [8] * 4
    assert ops(out / read_manifest(out).graph("head", 1).file)["MatMulNBits"] == [4]
    assert ops(out / "embed.decode.onnx")["Gather"] == [onnx.TensorProto.FLOAT]
    m = read_manifest(out)
    assert m.graph("embed", 1).data == "embed.data"     # the fp32 table left head.data with the int4 lm_head
    w = m.quantization["weights"]
    assert w["layers.0.attn.qkv.weight"]["bits"] == 32 and w["layers.1.mlp.down.weight"]["bits"] == 8
    assert w["lm_head.weight"]["bits"] == 4 and w["embed.weight"]["bits"] == 32
    got, _ = generate(out, PROMPT, 0)
    assert quality(got, torch_logits(model, PROMPT))[0] < BOUNDS[4][0]
    # --bits 4's default lm_head is int4 (group 32); the tied lookup reads the lm_head's int4 table itself
    # (quant/tied.py): one copy, in head.data
    out = quantize(src, tmp_path / "shared4", bits=4)
    assert ops(out / read_manifest(out).graph("head", 1).file)["MatMulNBits"] == [4]
    head = read_manifest(out).quantization["weights"]["lm_head.weight"]
    assert (head["bits"], head["block_size"]) == (4, 32)
    assert read_manifest(out).quantization["options"]["lm_head"] == "int4"
    # codes, and the int4 head's scales as MatMulNBits reads them (float32: --scales-dtype auto)
    assert ops(out / "embed.decode.onnx")["Gather"] == [onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT]
    assert read_manifest(out).graph("embed", 1).data == "head.data"
    e = read_manifest(out).quantization["weights"]["embed.weight"]
    assert e["shared_with"] == "lm_head" and e["bytes_after"] == 0
    got, _ = generate(out, PROMPT, 0)
    assert quality(got, torch_logits(model, PROMPT))[0] < BOUNDS[4][0]


def migrate_randomly(model: onnx.ModelProto, rng: np.random.Generator) -> tuple[onnx.ModelProto, list]:
    """A copy of `model` with every AWQ group migrated by random scales exp(N(0, 1))."""
    groups = find_groups(model.graph)
    inits = {t.name: t for t in model.graph.initializer}
    arrays: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        return arrays[name] if name in arrays else onnx.numpy_helper.to_array(inits[name])

    for g in groups:
        apply_group(get, arrays, g, np.exp(rng.standard_normal(get(g.weights[0]).shape[0])).astype(np.float32))
    migrated = onnx.ModelProto()
    migrated.CopyFrom(model)
    for t in migrated.graph.initializer:
        if t.name in arrays:
            t.CopyFrom(onnx.numpy_helper.from_array(arrays[t.name], t.name))
    return migrated, groups


def test_awq_migration_leaves_the_float_graphs_unchanged(tied, untied) -> None:
    """AWQ's scale migrations (random scales here) must not change any output of an fp32 graph, K/V rows
    included; the groups are the ones awq.py's docstring lists."""
    rng = np.random.default_rng(0)
    for src, file in ((tied[1], "layer_1.prefill.onnx"), (tied[1], "head.onnx"), (untied[1], "model.prefill.onnx")):
        model = onnx.load(src / file)
        migrated, groups = migrate_randomly(model, rng)
        inputs = _session(model).get_inputs()
        shapes = {i.name: [d if isinstance(d, int) else 4 for d in i.shape] for i in inputs}  # head.onnx: S = 4
        feeds = {i.name: (rng.integers(0, 256, shapes[i.name]) if "int" in i.type else rng.standard_normal(shapes[i.name]))
                 .astype(np.int64 if "int" in i.type else np.float32) for i in inputs}
        if "past_len" in feeds or "total_len" in feeds:  # a layer or model graph: 5 filled cache rows
            layout = "rows" if "past_len" in feeds else "inplace"
            feeds.update(step_feeds(layout, 5, inputs[0].shape[1], inputs[-1].shape[2]))
        for a, b in zip(_session(model).run(None, feeds), _session(migrated).run(None, feeds), strict=True):
            assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(a).max()), file
        kinds = sorted((g.kind, g.source) for g in groups)
        if file.startswith("layer"):
            assert kinds == [("gain", "layers.1.attn_norm.weight"), ("gain", "layers.1.mlp_norm.weight"),
                             ("up", "layers.1.mlp.gate_up.weight")]
        elif file.startswith("head"):      # tied: Gemm(Reshape(norm), E, transB=1) is no gain group (a tied lm_head
            assert kinds == []             # is never migrated: the lookup shares its table, awq.Migrator._search)
        else:                              # untied: the final norm -> lm_head too; 2 layers x 3
            assert len(kinds) == 7 and ("gain", "norm.weight") in kinds


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["quantize", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_prints_the_table_and_checks(untied, tied, tmp_path, capsys) -> None:
    _, src = untied
    code, out, _ = cli([src, "-o", tmp_path / "q", "--bits", "4", "--int8-layers", "0", "--lm-head", "fp32",
                        "--method", "rtn", "--int8-fraction", "0"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["weight", "scheme", "MB"] and lines[1].startswith("embed.weight")
    assert any(line.startswith("layers.0.attn.qkv.weight") and "int8-g32-sym-rtn" in line for line in lines)
    assert any(line.startswith("lm_head.weight") and " fp32 " in line for line in lines)
    assert any(line.startswith("total") for line in lines) and "export size:" in out and "check vs fp32" in out
    doc = json.loads((tmp_path / "q" / "manifest.json").read_text())
    check = doc["quantization"]["check"]
    assert check["positions"] > 0 and check["top1_agreement"] > 0.5
    assert "stack_vs_layers" not in doc["verification"]               # model granularity: no stack graph
    assert cli([tied[1], "-o", tmp_path / "t", "--bits", "4"], capsys)[0] == 0
    doc = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert 0 <= doc["verification"]["stack_vs_layers"] <= 1e-4      # the stack checked against its layers


@pytest.mark.parametrize(("args", "flag"), [
    (["--bits", "3"], "--bits"), (["--bits", "four"], "--bits"), (["--bits", "4", "--group-size", "48"], "--group-size"),
    (["--bits", "4", "--embeddings", "int4"], "--embeddings"), (["--bits", "4", "--method", "obq"], "--method"),
    (["--bits", "4", "--format", "qdq"], "--format"), (["--bits", "8", "--int8-layers", "0"], "--int8-layers"),
    (["--bits", "4", "--int8-layers", "2"], "--int8-layers"), (["--bits", "4", "--keep", "layer.0.*"], "--keep"),
    (["--bits", "4", "--accuracy-level", "2"], "--accuracy-level"),
    (["--bits", "4", "--int8-layers", "0,,1"], "--int8-layers: expected comma-separated integers, got '0,,1'"),
    (["--bits", "4", "--kl-budget", "low"], "--kl-budget: expected a number, got 'low'"),
    (["--bits", "4", "--group", "layers.*=48"], "--group layers.*=48: expected a block size"),
    (["--bits", "4", "--group", "layers.*"], "--group: expected PATTERN=N"),
    (["--bits", "4", "--group", "layer.*.mlp.down=64"], "--group layer.*.mlp.down=64: matches no weight"),
    (["--bits", "8", "--lm-head-int8-rows", "0.3"], "--lm-head-int8-rows: only with --bits 4"),
    (["--bits", "4", "--lm-head", "int4", "--lm-head-int8-rows", "0.3"], "--lm-head-int8-rows: only with --bits 4"),
    (["--bits", "4", "--lm-head-int8-rows", "0"], "--lm-head-int8-rows: expected a fraction"),
    (["--bits", "4", "--format", "portable", "--lm-head-int8-rows", "0.3"], "--lm-head-int8-rows: only with"),
    (["--bits", "8", "--profile", "small"], "--profile small: only with --bits 4, got --bits 8"),
    (["--bits", "4", "--profile", "small", "--kl-budget", "0.1"], "--profile: not with --kl-budget"),
])
def test_cli_errors_are_one_line(untied, tmp_path, capsys, args: list[str], flag: str) -> None:
    _, src = untied
    out = tmp_path / "q"
    code, _, err = cli([src, "-o", out, *args], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"edgellm quantize: error: {flag}"), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []      # nothing half-written


def test_cli_refuses_bad_directories(untied, tmp_path, capsys) -> None:
    _, src = untied
    quantized = quantize(src, tmp_path / "q8", bits=8)
    (tmp_path / "empty").mkdir()
    cases = [([src, "-o", src], "the input export itself"), ([src, "-o", src / "sub"], "inside the input"),
             ([tmp_path / "empty", "-o", tmp_path / "x"], "manifest.json: not found"),
             ([quantized, "-o", tmp_path / "x"], "already quantized")]
    for args, message in cases:
        code, _, err = cli([*args, "--bits", "4"], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_split_head_needs_an_export_of_format_10_or_later(tmp_path, capsys) -> None:
    """The split head's columns need manifest format 12, which a quantize of a 10+ export writes; an export of
    format 8-9 (no spare cache row, which only its version tells) cannot be relabelled: one-line error, nothing
    written, and `--lm-head-int8-rows 1` (no split) still quantizes it."""
    from edgellm.export.exporter import export_model
    from edgellm.export.options import ExportOptions
    from tests.export_helpers import tiny_model

    src = tmp_path / "v9"
    export_model(tiny_model("llama2", seed=3), src, ExportOptions(granularity="layer", attention="standard",
                                                                  max_seq=48, prefill_chunk=8),
                 progress=False, log=lambda _: None)
    doc = json.loads((src / "manifest.json").read_text())
    assert doc.pop("logit_columns") is None and doc["kv_layout"] == "rows"   # rows: no spare row in any format
    assert doc.pop("kv_dtype") == "float32"  # (format 14's key)
    (src / "manifest.json").write_text(json.dumps({**doc, "format_version": 9}))
    code, _, err = cli([src, "-o", tmp_path / "q", "--bits", "4", "--profile", "small", "--calibration-tokens", "64"],
                       capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "an export of format 9 cannot carry a split head (format 10 or later; re-export it, or pass " \
           "--lm-head-int8-rows 1)" in err and not (tmp_path / "q").exists()
    code, _, err = cli([src, "-o", tmp_path / "q", "--bits", "4", "--calibration-tokens", "64", "--no-check",
                        "--lm-head-int8-rows", "1"], capsys)
    assert code == 0 and read_manifest(tmp_path / "q").format_version == 9, err
