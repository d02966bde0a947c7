"""`edgellm export`: the directory it writes (names, shapes, shared data, manifest), the graph form the
quantizer and runtime rely on, CLI errors, verification failures, and resume after an interrupted run."""

from __future__ import annotations

import json
import lzma
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer, models

import edgellm.export.exporter as exporter
from edgellm.cli import main
from edgellm.export import ExportOptions, export_model
from edgellm.loaders import save_checkpoint
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.graphio import SPARE_ROWS
from edgellm.runtime.manifest import MANIFEST, READS, Manifest, read_manifest
from tests.export_helpers import onnx_generate_logits, tiny_model, torch_logits

SMALL = ["--max-seq", "64", "--prefill-chunk", "8", "--no-progress"]


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory):
    """A tied, biased Qwen2-style checkpoint with a tokenizer.json, exported through the CLI."""
    root = tmp_path_factory.mktemp("cli")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(200)}, unk_token="t0"))
    tok.save(str(root / "tokenizer.json"))
    model = tiny_model("qwen2", seed=5)
    save_checkpoint(model, root / "ckpt", tokenizer=root / "tokenizer.json")
    assert main(["export", str(root / "ckpt"), "-o", str(root / "out"), *SMALL]) == 0
    return root, model


def load_graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def externals(model: onnx.ModelProto) -> dict[str, tuple[str, int, int]]:
    """initializer name -> (location, offset, length) for external tensors."""
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            kv = {e.key: e.value for e in t.external_data}
            out[t.name] = (kv["location"], int(kv.get("offset", 0)), int(kv["length"]))
    return out


def test_cli_export_writes_a_complete_manifest(cli_export):
    root, model = cli_export
    out = root / "out"
    m = read_manifest(out, verify=True)
    cfg = model.cfg
    assert (m.preset, m.granularity, m.max_seq, m.prefill_chunk, m.opset) == ("qwen2", "layer", 64, 8, 20)
    assert m.config == cfg.to_dict() and (m.bos_id, m.eos_id) == (cfg.bos_id, cfg.eos_id)
    assert m.tokenizer == {"file": "tokenizer.json.xz", "kind": "hf", "chat_template": None, "add_bos": True}
    shipped = lzma.decompress((out / "tokenizer.json.xz").read_bytes())  # the same JSON value, minified, packed
    assert json.loads(shipped) == json.loads((root / "tokenizer.json").read_bytes()) and b"\n" not in shipped
    assert m.sampler == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.0}
    assert m.quantization is None and m.export_options["prefill_chunk"] == 8
    assert set(m.verification) == ({g.name for g in m.graphs if g.role not in ("stack", "stack_lone")}
                                   | {"end_to_end", "stack_vs_layers", "lone_vs_stack"})
    assert all(0 <= d < 1e-4 for d in m.verification.values())
    # exactly the listed files: no journal, no temp files; the partial directory is gone
    assert sorted(p.name for p in out.iterdir()) == sorted([*m.files, MANIFEST])
    assert not (root / "out.partial").exists()
    # round trip and version rejection
    assert Manifest.from_json(m.to_json()) == m
    doc = json.loads((out / MANIFEST).read_text())
    doc["format_version"] = max(READS) + 1
    with pytest.raises(EdgeError, match="format_version"):
        Manifest.from_json(json.dumps(doc))


def test_graph_files_match_the_manifest(cli_export):
    root, model = cli_export
    out = root / "out"
    m = read_manifest(out)
    stems = ["embed", "layer_0", "layer_1"]
    # the head's two variants are one graph (format 9, S symbolic: speculative decoding's k + 1 rows run it too)
    assert sorted(g.file for g in m.graphs) == sorted([f"{s}.{v}.onnx" for s in stems for v in ("prefill", "decode")]
                                                      + ["stack.onnx", "stack_lone.onnx", "head.onnx"] * 2)
    head = load_graph(out / "head.onnx")
    assert [d.dim_param or d.dim_value for d in head.graph.output[0].type.tensor_type.shape.dim] == \
        [1, "S", m.vocab_size] and {loc for loc, _, _ in externals(head).values()} == {m.graph("head", 1).data}
    # the stack (the runtime's path: embedding + every layer in one graph, S symbolic) reads the units' data
    # and the layers' one copy of the RoPE tables
    stack = load_graph(out / "stack.onnx")
    assert {loc for loc, _, _ in externals(stack).values()} == \
        {g.data for g in m.graphs if g.role in ("embed", "layer")} | {"rope.data"}
    assert [v.name for v in stack.graph.input] == [t.name for t in m.graph("stack", 1).inputs]
    lone = load_graph(out / "stack_lone.onnx")  # format 13: the same, without the spare attention row
    assert externals(lone) == externals(stack) and lone.graph.input == stack.graph.input
    types = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32}
    for g in (g for g in m.graphs if g.role not in ("stack", "stack_lone", "head")):
        proto = load_graph(out / g.file)
        assert proto.ir_version == 10 and {o.domain: o.version for o in proto.opset_import}[""] == 20
        for got, want in ((proto.graph.input, g.inputs), (proto.graph.output, g.outputs)):
            assert [(v.name, tuple(d.dim_value for d in v.type.tensor_type.shape.dim), v.type.tensor_type.elem_type)
                    for v in got] == [(t.name, t.shape, types[t.dtype]) for t in want]
        assert {loc for loc, _, _ in externals(proto).values()} == {g.data} | ({"rope.data"} if g.layer is not None else set())
    # both variants of a unit point at the same bytes of one data file
    for stem in stems:
        pre, dec = (externals(load_graph(out / f"{stem}.{v}.onnx")) for v in ("prefill", "decode"))
        weights = {k for k in pre if "weight" in k}
        assert weights and {k: pre[k] for k in weights} == {k: dec[k] for k in weights}
    # the sessions load and report the manifest's shapes
    sess = ort.InferenceSession(str(out / "layer_1.decode.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in sess.get_inputs()][-1] == ("past_value.1", [1, 2, 64 + SPARE_ROWS, 16])


def test_weights_are_quantizer_ready_and_stored_once(cli_export):
    root, model = cli_export
    out = root / "out"
    V, D = model.cfg.vocab_size, model.cfg.dim
    for stem, file in (("layer_0", "layer_0.decode.onnx"), ("head", "head.onnx")):  # head.onnx: paired
        proto = load_graph(out / file)
        inits = {t.name: t for t in proto.graph.initializer}
        b_inputs = [n.input[1] for n in proto.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]
        assert all(len(inits[b].dims) == 2 for b in b_inputs)
        transposed_weights = [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
        assert not transposed_weights
        if stem == "layer_0":  # [in, out] layout under the state-dict names
            assert sorted(b_inputs) == ["layers.0.attn.o.weight", "layers.0.attn.qkv.weight",
                                        "layers.0.mlp.down.weight", "layers.0.mlp.gate_up.weight"]
            assert list(inits["layers.0.attn.qkv.weight"].dims) == [D, 128]
        else:  # tied: Gemm(h, E [V, D], transB=1), E the state dict's table as it is
            (gemm,) = [n for n in proto.graph.node if n.op_type == "Gemm"]
            assert {a.name: a.i for a in gemm.attribute}.get("transB") == 1
            assert b_inputs == ["embed.weight"] and list(inits["embed.weight"].dims) == [V, D]
    # tied: the embedding graph gathers rows of the head's table in head.data; no second copy anywhere
    where = externals(load_graph(out / "head.onnx"))["embed.weight"]
    embed = load_graph(out / "embed.decode.onnx")
    assert externals(embed)["embed.weight"] == where
    (gather,) = [n for n in embed.graph.node if n.op_type == "Gather" and n.input[0] == "embed.weight"]
    assert {a.name: a.i for a in gather.attribute}.get("axis", 0) == 0  # a token reads one row, not D pages
    assert not (out / "embed.data").exists() and (out / "head.data").stat().st_size < 2 * V * D * 4
    table = np.fromfile(out / "head.data", np.float32, V * D, offset=where[1]).reshape(V, D)
    np.testing.assert_array_equal(table, model.embed.weight.detach().numpy())
    # a unit's data file holds state-dict tensors only; small graph constants (shapes) stay in the .onnx, the
    # RoPE tables are read from the one copy every layer shares (rope.data)
    ext = externals(load_graph(out / "layer_1.prefill.onnx"))
    assert {k for k, (file, _, _) in ext.items() if file == "layer_1.data"} == {
        f"layers.1.{n}" for n in ("attn_norm.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.o.weight",
                                  "mlp_norm.weight", "mlp.gate_up.weight", "mlp.down.weight")}
    assert {k for k, (file, _, _) in ext.items() if file == "rope.data"} == {"layers.1.rope.cos", "layers.1.rope.sin"}


@pytest.fixture(scope="module")
def standard_export(cli_export):
    """The same checkpoint with --attention standard: traced graphs of plain ONNX ops, kv_layout rows."""
    root, model = cli_export
    out = root / "standard"
    assert main(["export", str(root / "ckpt"), "-o", str(out), "--attention", "standard", *SMALL]) == 0
    return out, model


def test_fused_layers_are_a_dozen_kernels(cli_export, tmp_path):
    """The default layer graph: GroupQueryAttention reads and writes the cache in place, both norms fused;
    after onnxruntime's optimiser a layer is 11 nodes (+2 here: onnxruntime turns MatMul + bias into
    Reshape-Gemm-Reshape), and nothing copies or transposes the cache."""
    root, model = cli_export
    m = read_manifest(root / "out")
    assert m.kv_layout == "inplace" and m.export_options["attention"] == "fused"
    proto = load_graph(root / "out" / "layer_0.decode.onnx")
    for name in ("past_key.0", "past_value.0"):
        assert [n.op_type for n in proto.graph.node if name in n.input] == ["GroupQueryAttention"]
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(root / "out" / "layer_0.decode.onnx"), opts, providers=["CPUExecutionProvider"])
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node)
    assert ops["SimplifiedLayerNormalization"] == ops["SkipSimplifiedLayerNormalization"] == 1
    # + 4 tiny ones around GroupQueryAttention: Pad and Slice of its extra row, its lengths + 1 (export/fused.py)
    assert ops["MatMul"] + ops["Gemm"] == 4 and sum(ops.values()) <= 13 + 4, ops
    assert not {"Transpose", "Concat", "Where", "Softmax"} & set(ops)


def test_standard_export_has_only_onnx_ops_and_matches(standard_export):
    out, model = standard_export
    m = read_manifest(out)
    assert m.kv_layout == "rows"
    assert {n.domain for g in m.graphs for n in load_graph(out / g.file).graph.node} <= {"", "ai.onnx"}
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, model.cfg.vocab_size, 13)]
    got, generated = onnx_generate_logits(out, tokens, steps=3)
    np.testing.assert_allclose(got, torch_logits(model, tokens + generated), atol=1e-4, rtol=0)


def test_graphs_do_no_wasted_work(standard_export, tmp_path):
    out, _ = standard_export
    proto = load_graph(out / "layer_0.prefill.onnx")
    ops = Counter(n.op_type for n in proto.graph.node)
    # the causal mask is a folded constant; torch.rsqrt became Div so onnxruntime can fuse the RMSNorm
    assert not {"Trilu", "Range", "ConstantOfShape", "Expand", "Tile", "Shape", "Reciprocal"} & set(ops)
    consumers = {name: [n.op_type for n in proto.graph.node if name in n.input] for name in ("past_key.0", "past_value.0")}
    assert consumers == {"past_key.0": ["Transpose"], "past_value.0": ["MatMul"]}
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out / "layer_0.prefill.onnx"), opts, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node
    # both RMSNorms fused; the cache is read by the two attention matmuls only (K's transpose fused in)
    assert Counter(n.op_type for n in opt)["SimplifiedLayerNormalization"] == 2
    assert {name: [n.op_type for n in opt if name in n.input] for name in consumers} == \
        {"past_key.0": ["FusedMatMul"], "past_value.0": ["MatMul"]}


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-seq", "16", "--prefill-chunk", "32"], "--prefill-chunk 32 is larger than --max-seq 16"),
    (["--max-seq", "1"], "--max-seq: expected an integer >= 2"),
    (["--prefill-chunk", "0"], "--prefill-chunk: expected an integer >= 1"),
    (["--opset", "9"], "--opset: expected 18..21"),
])
def test_cli_flag_errors(tmp_path, capsys, flags, message):
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"edgellm export: error: {err.split('error: ', 1)[1]}" and message in err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "out").exists()


def test_cli_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["export", str(tmp_path / "notes.txt"), "-o", str(tmp_path / "out"), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "notes.txt: not a checkpoint" in err and err.count("\n") == 1


def test_max_seq_beyond_the_model_and_unrelated_output_dir(tmp_path):
    model = tiny_model("llama2", max_seq_len=32)
    with pytest.raises(EdgeError, match="--max-seq 64 exceeds the model's max_seq_len 32"):
        export_model(model, tmp_path / "out", ExportOptions(max_seq=64, prefill_chunk=8), progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(EdgeError, match="holds no manifest.json"):
        export_model(model, tmp_path / "mine", ExportOptions(max_seq=32, prefill_chunk=8), progress=False)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_verification_failure_is_an_edge_error(tmp_path):
    model = tiny_model("llama2")
    with pytest.raises(EdgeError, match=r"head\.prefill: onnxruntime differs from PyTorch by .* > --atol 1e-12"):
        export_model(model, tmp_path / "out", ExportOptions(max_seq=64, prefill_chunk=8, atol=1e-12),
                     progress=False, log=lambda _: None)
    assert not (tmp_path / "out").exists()


def interrupt_after(monkeypatch, units: int) -> None:
    """Simulate a kill (Ctrl-C) once `units` units have been exported and journaled."""
    real, calls = exporter.export_unit, []

    def export_unit(*args, **kwargs):
        if len(calls) == units:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(exporter, "export_unit", export_unit)


def test_interrupted_export_resumes_from_checksummed_units(tmp_path, monkeypatch):
    model = tiny_model("llama2", seed=2)
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    options = ExportOptions(max_seq=64, prefill_chunk=8)
    with monkeypatch.context() as mp:
        interrupt_after(mp, 3)
        with pytest.raises(KeyboardInterrupt):
            export_model(model, out, options, progress=False, log=lambda _: None)
    assert not out.exists()  # nothing that looks like an export
    journal = json.loads((partial / "journal.json").read_text())
    assert list(journal["units"]) == ["head", "embed", "layer_0"]
    data = bytearray((partial / "layer_0.data").read_bytes())
    data[100] ^= 0xFF  # one corrupted byte
    (partial / "layer_0.data").write_bytes(bytes(data))

    log: list[str] = []
    manifest = export_model(model, out, options, progress=False, log=log.append)
    assert "reusing head (checksums match)" in log and "reusing embed (checksums match)" in log
    assert "re-exporting layer_0: layer_0.data does not match its checksum" in log
    assert not any("layer_1" in line and "reusing" in line for line in log)
    assert not partial.exists() and read_manifest(out, verify=True) == manifest
    tokens = list(range(3, 23))
    got, generated = onnx_generate_logits(out, tokens, 4)
    assert np.abs(got - torch_logits(model, tokens + generated)).max() < 1e-4

    # a re-export killed half-way leaves the previous complete export untouched
    with monkeypatch.context() as mp:
        interrupt_after(mp, 1)
        with pytest.raises(KeyboardInterrupt):
            export_model(model, out, ExportOptions(max_seq=64, prefill_chunk=4), progress=False,
                         log=lambda _: None)
    assert read_manifest(out, verify=True) == manifest
    # ... and running with other options starts the partial directory over
    log.clear()
    with monkeypatch.context() as mp:
        interrupt_after(mp, 0)
        with pytest.raises(KeyboardInterrupt):
            export_model(model, out, options, progress=False, log=log.append)
    assert any("starting clean" in line for line in log)
    assert json.loads((partial / "journal.json").read_text())["units"] == {}
