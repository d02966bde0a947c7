"""Hostile and corrupted files: hypothesis corrupts the formats edgellm reads (checkpoint marker and its config,
safetensors headers, tokenizer.json, tokenizer.bin, llama2.c headers, ONNX protobuf) and every example must end
in a clean one-line EdgeError or a still-valid load - never another exception, never a hang (per-example
deadline). manifest.json bytes and values are fuzzed in tests/test_manifest.py already.

Safe loading: no pickle anywhere in the package; ONNX external-data locations cannot leave the export
directory; sizes read from headers are bounds-checked before anything is allocated."""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.cli import main
from edgellm.loaders import load_checkpoint, save_checkpoint
from edgellm.loaders.llama2c import Header
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.onnxmeta import read_graph_info
from edgellm.runtime.tokenizer import load_tokenizer
from tests.export_helpers import tiny_model
from tests.runtime_fixtures import bigram_export

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=80, deadline=5000, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
edits = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6)


def corrupt(data: bytes, changes: list[tuple[float, int]], cut: float | None, span: int | None = None) -> bytes:
    """Set bytes at relative positions (within the first `span` bytes if given); optionally truncate."""
    raw = bytearray(data)
    n = min(span or len(raw), len(raw))
    for where, byte in changes:
        raw[int(where * n)] = byte
    return bytes(raw if cut is None else raw[: int(cut * len(raw))])


def corrupted_copy(source: Path, target: Path, changes: list[tuple[float, int]], cut: float | None,
                   span: int | None = None) -> Path:
    """`target` holding `corrupt(source's bytes, ...)`."""
    target.write_bytes(corrupt(source.read_bytes(), changes, cut, span))
    return target


def clean(call, *args) -> object | None:
    """The call's result, or None after a one-line EdgeError; any other exception fails the example."""
    try:
        return call(*args)
    except EdgeError as err:
        assert "\n" not in str(err) and str(err)
        return None


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rel-fuzz")
    save_checkpoint(tiny_model("llama2", seed=0, dim=32, n_layers=1, n_heads=4, hidden_dim=32, vocab_size=64),
                    root / "ckpt")
    export = bigram_export(tmp_path_factory)
    tbin = root / "tokenizer.bin"  # llama2.c layout: 3 specials + the 256 byte pieces + 2 merges
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n", *(b"<0x%02X>" % b for b in range(256)), b"ab", b"abc"]
    tbin.write_bytes(struct.pack("<i", 6) + b"".join(struct.pack("<fi", -float(i), len(p)) + p
                                                     for i, p in enumerate(pieces)))
    l2c = root / "model.bin"  # llama2.c v0: dim 8, hidden 16, 1 layer, 2 heads, 2 kv heads, vocab 16, seq 8
    size = Header(0, 8, 16, 1, 2, 2, 16, 8, shared=True, weights_offset=28).file_bytes()
    l2c.write_bytes(struct.pack("<7i", 8, 16, 1, 2, 2, 16, 8) + b"\0" * (size - 28))
    tjson = root / "packed-tokenizer.json"  # the JSON the export packs (tokenizer.json.xz): fuzz the parser, not xz
    tjson.write_bytes(lzma.decompress((export / "tokenizer.json.xz").read_bytes()))
    return {"ckpt": root / "ckpt", "tokenizer.json": tjson, "onnx": export / "head.onnx",
            "tokenizer.bin": tbin, "model.bin": l2c, "work": root}


def scratch(files: dict[str, Path], name: str) -> Path:
    """A fresh copy of the fixture checkpoint for one example."""
    dst = files["work"] / name
    if dst.exists():
        shutil.rmtree(dst)
    return Path(shutil.copytree(files["ckpt"], dst))


# --------------------------------------------------------------------------------------------- fuzzing


def test_fixture_files_are_valid(files):
    """The base files load: every fuzz example starts from a good file, so a failure is the corruption's."""
    assert load_checkpoint(files["ckpt"]).config.dim == 32 and load_checkpoint(files["model.bin"]).config.dim == 8
    assert load_tokenizer(files["tokenizer.bin"], 261).encode("abc") == [0x20 + 3, 0x61 + 3, 0x62 + 3, 0x63 + 3]
    assert load_tokenizer(files["tokenizer.json"], 259).vocab_size == 259
    assert read_graph_info(files["onnx"]).external


@FUZZ
@given(changes=edits, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_checkpoint_marker_bytes(files, changes, cut):
    ck = scratch(files, "marker")
    corrupted_copy(files["ckpt"] / "edgellm.json", ck / "edgellm.json", changes, cut)
    clean(load_checkpoint, ck)


config_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**31, 2**40, 2**62]),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                          st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.none()))


@FUZZ
@given(data=st.data())
def test_fuzzed_checkpoint_config_values(files, data):
    """Random values for random ModelConfig fields (0 heads, 2**40 positions, strings, NaN, lists...)."""
    ck = scratch(files, "config")
    doc = json.loads((ck / "edgellm.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(doc["config"])))
        doc["config"][key] = data.draw(config_values)
    (ck / "edgellm.json").write_text(json.dumps(doc))
    clean(load_checkpoint, ck)


@FUZZ
@given(changes=edits)
def test_fuzzed_safetensors_header(files, changes):
    ck = scratch(files, "weights")
    blob = (files["ckpt"] / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(blob[:8], "little")
    (ck / "model.safetensors").write_bytes(corrupt(blob, changes, None, span=header))
    clean(load_checkpoint, ck)


@FUZZ
@given(changes=edits, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_tokenizer_json(files, changes, cut):
    path = corrupted_copy(files["tokenizer.json"], files["work"] / "tokenizer.json", changes, cut)
    tok = clean(load_tokenizer, path, 259)
    if tok is not None:  # still loadable: it must also work, or fail cleanly, on text and ids
        ids = clean(tok.encode, "héllo wörld 中")
        clean(tok.decode, ids or [0, 5, 258])


@FUZZ
@given(changes=edits, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_tokenizer_bin(files, changes, cut):
    path = corrupted_copy(files["tokenizer.bin"], files["work"] / "fuzz-tokenizer.bin", changes, cut)
    tok = clean(load_tokenizer, path, 261)
    if tok is not None:
        clean(tok.decode, clean(tok.encode, "abc ab\xff") or [1])


@FUZZ
@given(changes=edits, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_llama2c_header(files, changes, cut):
    clean(load_checkpoint, corrupted_copy(files["model.bin"], files["work"] / "fuzz.bin", changes, cut, span=28))


@FUZZ
@given(changes=edits, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_onnx_protobuf(files, changes, cut):
    """The runtime's own protobuf reader (the board has no `onnx` package) on corrupted graph files."""
    clean(read_graph_info, corrupted_copy(files["onnx"], files["work"] / "fuzz.onnx", changes, cut))


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("n_heads", 0, "n_heads must be positive"), ("n_kv_heads", 0, "n_kv_heads must be positive"),
    ("n_layers", 2**31, "n_layers=2147483648 is more than"),  # used to build 2**31 (meta) layers: GBs, minutes
    ("dim", "64", "dim: expected an integer"), ("dim", 32.0, "dim: expected an integer"),
    ("n_layers", True, "n_layers: expected an integer"), ("norm_eps", float("nan"), "norm_eps: expected a finite"),
    ("rope_theta", None, "rope_theta: expected a finite number"), ("qk_norm", 1, "qk_norm: expected true or false"),
])
def test_hostile_config_values_found_by_fuzzing(files, key, value, needle):
    """Each once escaped as ZeroDivisionError/TypeError from deep in torch, or exhausted memory."""
    ck = scratch(files, "hostile")
    doc = json.loads((ck / "edgellm.json").read_text())
    doc["config"][key] = value
    (ck / "edgellm.json").write_text(json.dumps(doc))
    with pytest.raises(EdgeError, match="edgellm.json: bad config: " + re.escape(needle)):
        load_checkpoint(ck)


# ---------------------------------------------------------------------------------------------- no pickle

PACKAGE_DIRS = ("edgellm", "export", "runtime", "quant")


def test_no_pickle_anywhere_in_the_package():
    """Loading a file never runs code: no pickle-based modules, torch.load only with weights_only=True,
    numpy.load only with allow_pickle=False."""
    sources = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 40
    bad = []
    for path in sources:
        code = "\n".join(line.split("#", 1)[0] for line in path.read_text(encoding="utf-8").splitlines())
        rel = path.relative_to(ROOT)
        if re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib|cloudpickle|shelve|marshal)\b", code, re.M):
            bad.append(f"{rel}: imports a pickle-based module")
        for call in re.finditer(r"\b(torch\.load|torch\.jit\.load|(?:np|numpy)\.load)\s*\(([^)]*)\)", code):
            safe = "weights_only=True" in call[2] if call[1] == "torch.load" else "allow_pickle=False" in call[2]
            if not safe or call[1] == "torch.jit.load":
                bad.append(f"{rel}: {call[0]}")
        if re.search(r"\bpickle\.(load|loads|Unpickler)\b", code):
            bad.append(f"{rel}: calls pickle")
    assert bad == []


# ----------------------------------------------------------------------------- external data path escapes


@pytest.fixture(scope="module")
def exports(tmp_path_factory, files) -> dict[str, Path]:
    """fp32: the bigram export; int8: `edgellm quantize --bits 8` of it (its graphs hold quantized ops)."""
    fp32 = bigram_export(tmp_path_factory)
    int8 = files["work"] / "int8"
    assert main(["quantize", str(fp32), "-o", str(int8), "--bits", "8", "--no-check", "--no-progress"]) == 0
    return {"fp32": fp32, "int8": int8}


def point_outside(directory: Path, location: str) -> None:
    """Rewrite layer_0.decode's graph file (a paired file in a quantized export) so its first external weight
    lives at `location`; reseal its sha256."""
    doc = json.loads((directory / "manifest.json").read_text())
    rel = next(g["file"] for g in doc["graphs"] if g["name"] == "layer_0.decode")
    path = directory / rel
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in tensor.external_data if e.key == "location").value = location
    onnx.save(model, str(path))
    doc["files"][rel] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}
    (directory / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "evil.data"])
@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_external_data_cannot_escape_the_export(tmp_path, capsys, exports, kind, location):
    """The runtime refuses BEFORE onnxruntime opens anything: the one-line error is the runtime's own."""
    bad = Path(shutil.copytree(exports[kind], tmp_path / "bad"))
    (bad / "evil.data").symlink_to("/etc/passwd")  # a symlink out of the directory
    point_outside(bad, location)
    assert main(["run", str(bad), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "onnxruntime" not in err, err
    assert "unsafe path" in err or "outside the directory" in err, err


# ----------------------------------------------------------------------------------- header size bombs

BOMB_SCRIPT = r"""
import json, resource, sys, time
from edgellm.loaders import load_checkpoint
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.onnxmeta import read_graph_info
from edgellm.runtime.tokenizer import load_tokenizer
from edgellm.train.data import build_token_file
readers = {"checkpoint": load_checkpoint, "tokenizer": lambda p: load_tokenizer(p, 300),
           "onnx": read_graph_info, "manifest": read_manifest,
           "npy": lambda p: build_token_file([p], p + ".tokens.bin", 64)}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = {}
for name, (kind, path) in json.loads(sys.argv[1]).items():
    start = time.perf_counter()
    try:
        readers[kind](path)
        message = None
    except EdgeError as err:
        message = str(err)
    report[name] = [message, time.perf_counter() - start]
report["rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(report))
"""


def test_sizes_in_headers_are_bounds_checked_before_allocation(tmp_path, files):
    """Headers that claim 2**60 bytes, 2**30-wide models or 2**40 tokens: a clean error naming the file,
    in well under a second each, without allocating what they claim (a fresh process measures its RSS)."""
    cases: dict[str, tuple[str, str]] = {}
    ck = Path(shutil.copytree(files["ckpt"], tmp_path / "st-2p60"))
    blob = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes((1 << 60).to_bytes(8, "little") + blob[8:])
    cases["safetensors header length 2**60"] = ("checkpoint", str(ck))
    ck2 = Path(shutil.copytree(files["ckpt"], tmp_path / "st-huge"))
    head = json.dumps({"embed.weight": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 2**62]}})
    (ck2 / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head.encode() + b"\0" * 64)
    cases["safetensors tensor of 2**62 bytes"] = ("checkpoint", str(ck2))
    l2c = tmp_path / "huge.bin"
    l2c.write_bytes(struct.pack("<7i", 2**30, 2**30, 2**10, 2**5, 2**5, 2**30, 2**30) + b"\0" * 4096)
    cases["llama2.c dims 2**30"] = ("checkpoint", str(l2c))
    tok = tmp_path / "tokenizer.bin"
    tok.write_bytes(struct.pack("<ifi", 2**31 - 1, 0.0, 2**31 - 1) + b"x" * 64)
    cases["tokenizer.bin piece of 2**31 bytes"] = ("tokenizer", str(tok))
    onnx_ = tmp_path / "huge.onnx"
    onnx_.write_bytes(b"\x3a" + bytes([0x80] * 8 + [0x10]) + b"\0" * 16)  # graph field, varint length 2**60
    cases["onnx field of 2**60 bytes"] = ("onnx", str(onnx_))
    man = tmp_path / "big-manifest"
    man.mkdir()
    with open(man / "manifest.json", "wb") as fh:
        fh.truncate(65 << 20)  # sparse: 65 MB claimed, nothing on disk
    cases["manifest.json of 65 MB"] = ("manifest", str(man))
    npy = tmp_path / "tokens.npy"
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (1099511627776,), }".ljust(117) + "\n"
    npy.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * 64)
    np.lib.format.read_magic(open(npy, "rb"))  # a well-formed .npy header claiming 2**40 tokens
    cases[".npy of 2**40 tokens"] = ("npy", str(npy))

    proc = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    for name, (_, path) in cases.items():
        message, seconds = report[name]
        assert message is not None and Path(path).name in message and "\n" not in message, (name, message)
        assert seconds < 2.0, (name, seconds)
    assert report["rss_growth_mb"] < 100, report
