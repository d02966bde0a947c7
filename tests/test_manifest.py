"""manifest.json: round trips, older versions, loud rejections naming the key or file, path escapes, and
byte-level fuzzing that must only ever produce EdgeError. (The file helpers: test_fileio.py.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import describe_files, safe_join
from edgellm.runtime.graphio import SPARE_ROWS, dims_from_config, graph_io, graph_paths, spare_rows
from edgellm.runtime.manifest import FORMAT_VERSION, MANIFEST, GraphSpec, Manifest, read_manifest

CONFIG = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": None, "dim": 16, "vocab_size": 32,
          "rope_theta": 10000.0, "rope_scaling": [1.0, 0.5]}


def make_export(root: Path, granularity: str = "layer", prefill_chunk: int = 4, kv_layout: str = "rows",
                kv_head_dim: int | None = None, config: dict = CONFIG, version: int = FORMAT_VERSION) -> Manifest:
    """A complete export directory with placeholder graph bytes and a manifest written by Manifest.write."""
    root.mkdir(parents=True, exist_ok=True)
    dims = dims_from_config(config, max_seq=16, kv_layout=kv_layout, kv_head_dim=kv_head_dim,
                            spare=spare_rows(kv_layout, version))
    roles = [("embed", None), ("layer", 0), ("layer", 1), ("head", None)] if granularity == "layer" else [("model", None)]
    graphs = []
    for role, layer in roles:
        for seq in sorted({prefill_chunk, 1}, reverse=True):
            name, file, data = graph_paths(role, seq, layer)
            inputs, outputs = graph_io(role, seq, layer, dims)
            graphs.append(GraphSpec(name, role, layer, seq, file, data, inputs, outputs))
            (root / file).write_bytes(f"onnx {name}".encode())
            (root / data).write_bytes(f"weights of {data}".encode() * 10)
    (root / "tokenizer.json").write_text('{"model": {}}')
    relpaths = sorted({g.file for g in graphs} | {g.data for g in graphs} | {"tokenizer.json"})
    manifest = Manifest(
        edgellm_version="0.1.0", preset="llama", config=config, granularity=granularity, kv_layout=kv_layout,
        max_seq=16,
        prefill_chunk=prefill_chunk, opset=21, graphs=tuple(graphs), files=describe_files(root, relpaths),
        tokenizer={"file": "tokenizer.json", "kind": "hf", "chat_template": None, "add_bos": True}, bos_id=1, eos_id=2, eos_ids=(2, 5),
        sampler={"temperature": 0.8, "top_p": 0.95}, quantization=None, export_options={"dynamo": False},
        verification={g.name: 1e-6 for g in graphs}, kv_head_dim=kv_head_dim,
        kv_cache_rows=dims.rows if any(r != 16 for r in dims.rows) else None, format_version=version,
    )
    manifest.write(root)
    return manifest


def edit(root: Path, change) -> None:
    doc = json.loads((root / MANIFEST).read_text())
    change(doc)
    (root / MANIFEST).write_text(json.dumps(doc))


def rejects(root: Path, match: str, verify: bool = True) -> None:
    with pytest.raises(EdgeError, match=match):
        read_manifest(root, verify=verify)


# -------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("granularity,chunk,layout", [("layer", 4, "rows"), ("model", 4, "rows"), ("layer", 1, "rows"),
                                                      ("layer", 4, "inplace")])
def test_round_trip(tmp_path: Path, granularity: str, chunk: int, layout: str) -> None:
    written = make_export(tmp_path, granularity, chunk, layout)
    text = (tmp_path / MANIFEST).read_text()
    got = read_manifest(tmp_path)
    assert got == written
    assert got.to_json() == text
    assert json.loads(text)["format_version"] == FORMAT_VERSION == 14
    assert json.loads(text)["kv_layout"] == got.kv_layout == layout
    rows = 16 + (SPARE_ROWS if layout == "inplace" else 0)
    assert f'"shape": [1, 2, {rows}, 4]' in text  # shapes on one line
    assert (got.n_layers, got.n_kv_heads, got.head_dim, got.dim, got.vocab_size) == (2, 2, 4, 16, 32)
    if granularity == "layer":
        g = got.graph("layer", 1, layer=1)
        assert (g.name, g.file, g.data) == ("layer_1.decode", "layer_1.decode.onnx", "layer_1.data")
        positions = ["positions", "past_len"] if layout == "rows" else ["seqlens_k", "total_len"]
        assert [t.name for t in g.inputs] == ["hidden", *positions, "past_key.1", "past_value.1"]
        assert [t.name for t in g.outputs] == ["hidden_out", "present_key.1", "present_value.1"]
        present = 1 if layout == "rows" else rows  # inplace: present_* is the whole cache
        assert g.outputs[1].shape == (1, 2, present, 4)
    else:
        g = got.graph("model", chunk)
        assert g.inputs[3].shape == (1, 2, 16, 4) and g.outputs[0].shape == (1, chunk, 32)
        assert [t.name for t in g.outputs] == ["logits", "present_key.0", "present_value.0",
                                               "present_key.1", "present_value.1"]
    with pytest.raises(EdgeError, match="no head graph with seq=3"):
        got.graph("head", 3)


def pair_layer_0(doc: dict, variants: tuple[int, ...] = (4, 1)) -> None:
    """Edit a manifest so that layer 0's variants (by S) name one paired file."""
    for g in doc["graphs"]:
        if g["role"] == "layer" and g["layer"] == 0 and g["seq"] in variants:
            g.update(paired=True, file="layer_0.decode.onnx")


def test_paired_graphs(tmp_path: Path) -> None:
    """A paired layer is one file for both variants; format 3-4's `decode` selector input is refused."""
    make_export(tmp_path, kv_layout="inplace")
    edit(tmp_path, pair_layer_0)
    got = read_manifest(tmp_path)
    pair = [g for g in got.graphs if g.paired]
    assert [(g.name, g.file) for g in pair] == [
        ("layer_0.prefill", "layer_0.decode.onnx"), ("layer_0.decode", "layer_0.decode.onnx")]
    assert Manifest.from_json(got.to_json()) == got
    edit(tmp_path, lambda d: d["graphs"][2]["inputs"].append({"name": "decode", "shape": [], "dtype": "bool"}))
    rejects(tmp_path, r"graphs\[2\] \(layer_0\.prefill\)\.inputs: expected names \[.*\], got \[.*'decode'\]")
    make_export(tmp_path / "one", kv_layout="inplace")
    edit(tmp_path / "one", lambda d: pair_layer_0(d, variants=(1,)))
    rejects(tmp_path / "one", r"graphs\[3\] \(layer_0\.decode\)\.paired: the other variant of layer 0 must be paired")
    make_export(tmp_path / "rows")
    edit(tmp_path / "rows", pair_layer_0)
    rejects(tmp_path / "rows", r"\.paired: only layer, stack or head graphs of an 'inplace' export")


def add_stack(doc: dict, variants: tuple[int, ...] = (4, 1), file: str = "stack.onnx") -> None:
    """Edit a manifest to add the stack graph's variants (by S), paired in `file` (listed in files)."""
    dims = dims_from_config(CONFIG, max_seq=16, kv_layout="inplace", spare=SPARE_ROWS)
    for seq in variants:
        inputs, outputs = graph_io("stack", seq, None, dims)
        tensor = lambda t: {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}  # noqa: E731
        doc["graphs"].append({"name": f"stack.{'decode' if seq == 1 else 'prefill'}", "role": "stack", "layer": None,
                              "seq": seq, "file": file, "data": None, "paired": True,
                              "inputs": [tensor(t) for t in inputs],
                              "outputs": [tensor(t) for t in outputs]})
    doc["files"][file] = doc["files"]["layer_0.decode.onnx"]


def test_stack_graphs(tmp_path: Path) -> None:
    """An optional stack graph (embedding + every layer), both variants paired in one file."""
    make_export(tmp_path, kv_layout="inplace")
    assert not read_manifest(tmp_path, verify=False).has_stack
    (tmp_path / "stack.onnx").write_bytes((tmp_path / "layer_0.decode.onnx").read_bytes())
    edit(tmp_path, add_stack)
    got = read_manifest(tmp_path)
    assert got.has_stack and got.graph("stack", 1).inputs[0].name == "tokens"
    assert got.graph("stack", 4).outputs[0].shape == (1, 4, CONFIG["dim"])
    assert Manifest.from_json(got.to_json()) == got
    make_export(tmp_path / "half", kv_layout="inplace")
    (tmp_path / "half" / "stack.onnx").write_bytes((tmp_path / "half" / "layer_0.decode.onnx").read_bytes())
    edit(tmp_path / "half", lambda d: add_stack(d, variants=(1,)))
    rejects(tmp_path / "half", r"graphs: missing \(role, layer, seq\) \[\('stack', None, 4\)\]")
    make_export(tmp_path / "rows")
    (tmp_path / "rows" / "stack.onnx").write_bytes(b"x")
    edit(tmp_path / "rows", add_stack)
    rejects(tmp_path / "rows", "stack graphs exist for kv_layout 'inplace' only")


def test_inplace_layout_needs_layer_granularity(tmp_path: Path) -> None:
    make_export(tmp_path, "model")
    edit(tmp_path, lambda d: d.update(kv_layout="inplace"))
    rejects(tmp_path, "kv_layout: 'inplace' needs granularity 'layer'")
    edit(tmp_path, lambda d: d.update(kv_layout="paged"))
    rejects(tmp_path, "kv_layout: expected one of rows, inplace")


# ----------------------------------------------------------------------------------------------- rejects


def test_unknown_version_is_rejected_by_name(tmp_path: Path) -> None:
    make_export(tmp_path)
    edit(tmp_path, lambda d: d.update(format_version=17, brand_new_key=1))
    rejects(tmp_path, r"manifest\.json: format_version 17 is not supported \(this edgellm reads 8-16; update edgellm\)")
    edit(tmp_path, lambda d: d.update(format="onnx-genai"))
    rejects(tmp_path, "format: expected 'edgellm-export'")


@pytest.mark.parametrize("change,match", [
    (lambda d: d.pop("max_seq"), r"missing key\(s\) \['max_seq'\]"),
    (lambda d: d.update(extra=1), r"unknown key\(s\) \['extra'\]"),
    (lambda d: d["graphs"][0].update(seq="4"), r"graphs\[0\]\.seq: expected integer, got string"),
    (lambda d: d["graphs"][0]["inputs"][0].pop("dtype"), r"graphs\[0\]\.inputs\[0\]: missing key"),
    (lambda d: d["graphs"][2]["inputs"][3].update(name="past_key.7"), r"graphs\[2\].*inputs: expected names"),
    (lambda d: d["graphs"][2]["outputs"][1].update(shape=[1, 2, 16, 4]), r"present_key\.0: expected \[1, 2, 4, 4\]"),
    (lambda d: d["graphs"][0].update(seq=3), r"seq: expected 1 or prefill_chunk=4"),
    (lambda d: d["graphs"][0].update(role="model"), "role: expected one of"),
    (lambda d: d["graphs"].pop(3), r"missing \(role, layer, seq\) \[\('layer', 0, 1\)\]"),
    (lambda d: d["files"].pop("head.data"), "'head.data' is not listed in files"),
    (lambda d: d["config"].pop("n_kv_heads"), "config: missing key 'n_kv_heads'"),
    (lambda d: d.update(eos_id=32), r"eos_id: expected 0\.\.31"),
    (lambda d: d.update(eos_ids=[5, 2]), r"eos_ids: expected eos_id \(2\) first"),
    (lambda d: d.update(eos_ids=[2, 40]), r"eos_ids\[1\]: expected 0\.\.31, got 40"),
    (lambda d: d.update(eos_ids=[2, 2]), "eos_ids: duplicate ids"),
    (lambda d: d.update(eos_ids=[2, "5"]), r"eos_ids\[1\]: expected 0\.\.31, got '5'"),
    (lambda d: d.pop("eos_ids"), r"missing key\(s\) \['eos_ids'\]"),
    (lambda d: d["tokenizer"].update(chat_template="chat.jinja"), "tokenizer.chat_template: 'chat.jinja' is not listed"),
    (lambda d: d["tokenizer"].pop("chat_template"), "tokenizer: expected keys 'file', 'kind', 'chat_template'"),
    (lambda d: d["tokenizer"].pop("add_bos"), "tokenizer: expected keys 'file', 'kind', 'chat_template', 'add_bos'"),
    (lambda d: d["tokenizer"].update(add_bos=1), "tokenizer.add_bos: expected true or false, got 1"),
    (lambda d: d["tokenizer"].update(add_bos="yes"), "tokenizer.add_bos: expected true or false, got 'yes'"),
    (lambda d: d.update(bos_id=None), "tokenizer.add_bos: true needs a bos_id"),
    (lambda d: d["tokenizer"].update(kind="spm"), "tokenizer.kind: expected one of hf, llama2c, got 'spm'"),
    (lambda d: d.update(sampler={"top_p": 2}), "sampler: top_p: expected"),
    (lambda d: d.update(verification={"x": "small"}), r"verification\['x'\]: expected number"),
    (lambda d: d.update(bos_id=True), "bos_id: expected integer or null, got boolean"),
    (lambda d: d.pop("logit_columns"), r"missing key\(s\) \['logit_columns'\]"),
    (lambda d: d.update(logit_columns="cols.i32"), "logit_columns: 'cols.i32' is not listed in files"),
    (lambda d: d.update(logit_columns=3), "logit_columns: expected string or null, got integer"),
    (lambda d: (d.update(format_version=11), d.pop("kv_dtype")), r"unknown key\(s\) \['logit_columns'\]"),  # 12's
    (lambda d: d.update(format_version=13), r"unknown key\(s\) \['kv_dtype'\]"),   # a 14 key in a 13
    (lambda d: d.pop("kv_dtype"), r"missing key\(s\) \['kv_dtype'\]"),
    (lambda d: d.update(kv_dtype="int4"), "kv_dtype: expected one of float32, float16, int8, got 'int4'"),
    (lambda d: d.update(kv_dtype="int8"), "kv_dtype: 'int8' needs format_version 15, this manifest says 14"),
    (lambda d: d.update(kv_dtype="int8", format_version=15), r"kv_dtype: a int8 cache is written by the fused"),
    (lambda d: d.update(kv_dtype="float16"), r"kv_dtype: a float16 cache is written by the fused layers only"),
])
def test_malformed_manifest_names_the_key(tmp_path: Path, change, match: str) -> None:
    make_export(tmp_path)
    edit(tmp_path, change)
    rejects(tmp_path, match)


def test_logit_columns_need_format_12_and_a_head(tmp_path: Path) -> None:
    """Format 12's head column order is read only from 12 on; an 11 manifest reads without the key and is
    written back without it."""
    old = make_export(tmp_path / "v11", version=11)
    assert old.logit_columns is None and "logit_columns" not in (tmp_path / "v11" / MANIFEST).read_text()
    assert read_manifest(tmp_path / "v11") == old
    make_export(tmp_path / "v12")
    (tmp_path / "v12" / "logit_columns.i32").write_bytes(np.arange(32, dtype="<i4").tobytes())

    def add(d: dict) -> None:
        d["files"]["logit_columns.i32"] = {"sha256": hashlib.sha256(np.arange(32, dtype="<i4").tobytes()).hexdigest(),
                                           "bytes": 128}
        d["logit_columns"] = "logit_columns.i32"
    edit(tmp_path / "v12", add)
    assert read_manifest(tmp_path / "v12").logit_columns == "logit_columns.i32"
    with pytest.raises(EdgeError, match="logit_columns: needs format_version 12, this manifest says 11"):
        dataclasses.replace(read_manifest(tmp_path / "v12"), format_version=11)
    model = make_export(tmp_path / "model", granularity="model")
    with pytest.raises(EdgeError, match="logit_columns: only a head graph"):
        dataclasses.replace(model, logit_columns="tokenizer.json")


def test_not_json_and_missing_manifest(tmp_path: Path) -> None:
    rejects(tmp_path, "manifest.json: not found")
    (tmp_path / MANIFEST).write_bytes(b"\xff\xfe{")
    rejects(tmp_path, "manifest.json: not valid JSON")
    (tmp_path / MANIFEST).write_text('{"format_version": NaN}')
    rejects(tmp_path, "NaN is not allowed")


def test_missing_truncated_and_altered_files(tmp_path: Path) -> None:
    make_export(tmp_path)
    data = tmp_path / "layer_1.data"
    original = data.read_bytes()
    data.write_bytes(original[:-1])
    rejects(tmp_path, r"layer_1\.data: \d+ bytes, the manifest says")
    data.write_bytes(original[:-1] + b"X")  # same size, other bytes
    rejects(tmp_path, r"layer_1\.data: sha256 differs")
    read_manifest(tmp_path, verify=False)  # sizes only: the hash is skipped
    data.unlink()
    rejects(tmp_path, r"layer_1\.data: listed in files but missing", verify=False)


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../x", "a\\..\\x", "C:x", "", "."])
def test_path_escapes_are_refused(tmp_path: Path, rel: str) -> None:
    root = tmp_path / "export"
    make_export(root)
    (tmp_path / "x").write_text("outside")
    edit(root, lambda d: d["files"].update({rel: {"sha256": "0" * 64, "bytes": 7}}))
    rejects(root, "unsafe path")
    with pytest.raises(EdgeError, match="unsafe path"):
        safe_join(root, rel)


def test_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "export"
    make_export(root)
    secret = tmp_path / "secret.data"
    secret.write_bytes(b"weights of head.data" * 10)  # would even pass the size and hash checks
    (root / "head.data").unlink()
    os.symlink(secret, root / "head.data")
    rejects(root, "'head.data' resolves outside the directory")
    os.symlink(tmp_path, root / "up")
    with pytest.raises(EdgeError, match="resolves outside"):
        safe_join(root, "up/secret.data")
    os.symlink("loop", root / "loop")
    with pytest.raises(EdgeError, match="loop"):
        safe_join(root, "loop/x")
    assert safe_join(root, "sub//./head.data") == root / "sub" / "head.data"


def test_write_refuses_a_manifest_whose_files_are_absent(tmp_path: Path) -> None:
    manifest = make_export(tmp_path / "a")
    with pytest.raises(EdgeError, match="embed.data: listed in files but missing"):
        manifest.write(tmp_path / "b")
    assert not (tmp_path / "b" / MANIFEST).exists()


@settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_manifest_bytes_only_ever_raise_edge_error(tmp_path: Path, edits, cut) -> None:
    root = tmp_path / "fuzz"
    if not (root / MANIFEST).exists():
        make_export(root)
        (root / "valid.json").write_bytes((root / MANIFEST).read_bytes())
    raw = bytearray((root / "valid.json").read_bytes())
    for where, byte in edits:
        raw[int(where * len(raw))] = byte
    if cut is not None:
        raw = raw[: int(cut * len(raw))]
    (root / MANIFEST).write_bytes(bytes(raw))
    try:
        read_manifest(root)  # a corruption can keep it valid (a space for a newline, a digit in a version)
    except EdgeError as err:
        assert "\n" not in str(err) and str(err).startswith(str(root / MANIFEST))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 40) | st.floats(-1, 4) | st.sampled_from(["", "layer", "../x", "int64"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["file", "kind", "name"]), inner, max_size=2),
    max_leaves=6)


def nodes(tree: object, path: tuple = ()) -> list[tuple]:
    """Paths of every value in a JSON tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    return [path] + [p for key, value in items for p in nodes(value, (*path, key))]


@settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifest_values_only_ever_raise_edge_error(tmp_path: Path, data) -> None:
    """Replace or delete random values of a valid manifest: the validator must stay total (no TypeError).

    deadline=5000 ms per example: a corrupt count must never make validation hang."""
    if not (tmp_path / MANIFEST).exists():  # one tmp_path for all examples: build the export once
        make_export(tmp_path)
    doc = json.loads((tmp_path / MANIFEST).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, key = data.draw(st.sampled_from(nodes(doc)[1:]))
        parent = doc
        for k in parents:
            parent = parent[k]
        if data.draw(st.booleans()):
            parent[key] = data.draw(json_values)
        else:
            del parent[key]
    try:
        Manifest.from_json(json.dumps(doc))
    except EdgeError:
        pass
