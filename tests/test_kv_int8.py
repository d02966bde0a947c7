"""An int8 KV cache (`quantize --kv-dtype int8`, manifest format 15): GroupQueryAttention writes round(x / scale)
clipped to int8 with static per-(kv head, channel) scales calibrated on the fp32 export's own K/V, the runtime
allocates a quarter of the fp32 cache's bytes, the lone-row stack is then bit for bit the spare-row stack (so greedy
decoding runs it and speculation stays exact), and what cannot hold one is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.diff.collect_ort import export_trace, open_engine, stored_cache_scales
from edgellm.export import ExportOptions, export_model
from edgellm.quant import kv_int8
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from edgellm.runtime.engine import Engine
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.generator import Generator
from edgellm.runtime.manifest import KV_INT8_SINCE, Manifest, read_manifest
from edgellm.runtime.sampling import SamplingParams
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import assert_exact_speculation, tiny_model

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 256, 10)] * 3
GREEDY = SamplingParams(temperature=0)
KV_ONLY = dict(bits=8, keep=("*",), embeddings="fp32", lm_head="fp32")  # weights stay fp32: the cache alone


def export(out: Path, kv_dtype: str = "float32", attention: str = "fused") -> Path:
    export_model(tiny_model("llama2", seed=0), out, ExportOptions(max_seq=96, prefill_chunk=8, kv_dtype=kv_dtype,
                                                                  attention=attention),
                 progress=False, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv8")
    src = export(root / "fp32")
    out = {"fp32": src}
    for name, kw in (("kv8", KV_ONLY), ("int4-kv8", dict(bits=4, method="rtn"))):
        quantize_export(src, root / name, QuantizeOptions(kv_dtype="int8", **kw), progress=False, log=lambda _: None)
        out[name] = root / name
    return out


def test_an_int8_cache_quarters_the_cache_and_holds_round_x_over_scale(exports) -> None:
    d8, d32 = exports["kv8"], exports["fp32"]
    m8 = read_manifest(d8)
    assert (m8.kv_dtype, m8.format_version) == ("int8", KV_INT8_SINCE)
    assert all(t.dtype == "int8" for g in m8.graphs for t in (*g.inputs, *g.outputs)
               if t.name.startswith(("past_", "present_")))
    g8, g32 = Generator.open(d8), Generator.open(d32)
    assert {a.dtype for a in g8.cache.keys + g8.cache.values} == {np.dtype(np.int8)}
    assert sum(a.nbytes for a in g8.cache.keys) * 4 == sum(a.nbytes for a in g32.cache.keys)
    # layer 0 reads the same (fp32) embedding rows in both, so its new K/V rows are the fp32 export's, rounded
    e8, e32 = Engine.open(d8, m8), Engine.open(d32, read_manifest(d32))
    e8.forward_rows(PROMPT)
    e32.forward_rows(PROMPT)
    n = len(PROMPT)
    for got, ref, scale in zip((e8.cache.keys[0], e8.cache.values[0]), (e32.cache.keys[0], e32.cache.values[0]),
                               stored_cache_scales(d8, m8)[0], strict=True):
        want = np.clip(np.round(ref[:, :, :n] / scale[None]), -128, 127)
        assert np.abs(got[:, :, :n].astype(np.int32) - want).max() <= 1  # a tie at .5 may round either way
        assert (got[:, :, :n] == want).mean() > 0.99
        assert np.abs(got[:, :, :n]).max() > 20  # the scales use the range, they do not crush it
    record = m8.quantization["kv_cache"]
    assert record["dtype"] == "int8" and record["margin"] == kv_int8.MARGIN and len(record["max_scale"]) == 2


def test_the_scales_cover_what_calibration_saw_with_the_margin(exports, tmp_path: Path) -> None:
    src = exports["fp32"]
    seqs = [PROMPT, PROMPT[::-1]]
    scales = kv_int8.cache_scales(src, read_manifest(src), seqs)
    engine = Engine.open(src, read_manifest(src))
    peak = np.zeros_like(scales[1][1][:, 0])
    for seq in seqs:
        engine.cache.reset()
        engine.forward_rows(seq)
        peak = np.maximum(peak, np.abs(engine.cache.values[1][0, :, :len(seq)]).max(axis=1))
    np.testing.assert_allclose(scales[1][1][:, 0] * 127 / kv_int8.MARGIN, peak, rtol=1e-6)


def test_the_diff_reads_an_int8_cache_as_the_kernel_does(exports) -> None:
    traces = {k: export_trace(open_engine(exports[k], read_manifest(exports[k])), PROMPT) for k in ("fp32", "kv8")}
    k32, k8 = traces["fp32"].keys[0], traces["kv8"].keys[0]   # layer 0: the same inputs, rows rounded
    step = stored_cache_scales(exports["kv8"], read_manifest(exports["kv8"]))[0][0]   # [n_kv, 1, hd]; rows [n_kv, T, hd]
    assert k8.dtype == np.float32 and np.abs(k8 - k32).max() > 0
    assert np.all(np.abs(k8 - k32) <= step * 0.5 + 1e-6)  # within half a step of the fp32 row: not the raw codes


def test_int8_cache_logits_stay_close_to_the_fp32_cache(exports) -> None:
    rows = {k: Engine.open(exports[k], read_manifest(exports[k])).forward_rows(PROMPT) for k in ("fp32", "kv8")}
    lp = {k: v - np.log(np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True)) - v.max(-1, keepdims=True)
          for k, v in rows.items()}
    kl = (np.exp(lp["fp32"]) * (lp["fp32"] - lp["kv8"])).sum(-1).mean()
    assert 0 < kl < 0.02
    assert (rows["fp32"].argmax(-1) == rows["kv8"].argmax(-1)).mean() >= 0.9
    assert read_manifest(exports["kv8"]).quantization["check"]["mean_kl"] < 0.02


@pytest.mark.parametrize("name", ["kv8", "int4-kv8"])
def test_the_lone_row_stack_is_exact_with_an_int8_cache(exports, name: str) -> None:
    d = exports[name]
    m = read_manifest(d)
    assert m.verification["lone_vs_stack"] == 0.0  # quantize's own check: bit for bit
    # the exact config opens the lone-row stack: its rows are exact
    assert assert_exact_speculation(d, PROMPT).stack_role == "stack_lone"


def test_an_fp32_cache_keeps_the_spare_row_stack_for_exact_rows(exports) -> None:
    d = exports["fp32"]
    assert Engine.open(d, read_manifest(d), SessionConfig(exact=True)).stack_role == "stack"
    assert Engine.open(d, read_manifest(d)).stack_role == "stack_lone"    # the default: until speculation is on
    lone = Engine.open(d, read_manifest(d), SessionConfig(exact=False))
    assert lone.stack_role == "stack_lone" and not lone.exact_rows


def test_what_cannot_hold_an_int8_cache_is_refused(exports, tmp_path: Path) -> None:
    kv16 = export(tmp_path / "kv16", kv_dtype="float16")
    standard = export(tmp_path / "std", attention="standard")
    for src, message in ((kv16, "the export's cache is float16; quantize an export made with --kv-dtype float32"),
                         (standard, "the cache is written by the fused layers only"),
                         (exports["kv8"], "already quantized")):
        with pytest.raises(EdgeError, match=message):
            quantize_export(src, tmp_path / "out", QuantizeOptions(bits=8, kv_dtype="int8"), progress=False,
                            log=lambda _: None)
        assert not (tmp_path / "out").exists()
    with pytest.raises(EdgeError, match=r"^--kv-dtype: expected auto, float32, float16, int8, got 'int4'"):
        QuantizeOptions(kv_dtype="int4").validate()
    with pytest.raises(EdgeError, match=r"--kv-dtype: expected one of float32, float16, got 'int8' \(an int8 "):
        ExportOptions(kv_dtype="int8").validate()


def test_the_manifest_versions_an_int8_cache(exports) -> None:
    doc = json.loads((exports["kv8"] / "manifest.json").read_text())
    assert (doc["format_version"], doc["kv_dtype"]) == (15, "int8")
    Manifest.from_json(json.dumps(doc))
    with pytest.raises(EdgeError, match=r"^kv_dtype: 'int8' needs format_version 15, this manifest says 14"):
        Manifest.from_json(json.dumps({**doc, "format_version": 14}))


def test_the_cli_quantizes_the_cache_and_info_prints_it(exports, tmp_path: Path, capsys) -> None:
    from edgellm.cli import main

    src = str(exports["fp32"])
    for name, flags, want in (("int8", ["--bits", "8", "--kv-dtype", "int8"], "int8"), ("q8", ["--bits", "8"], "float32"),
                              ("q4", ["--bits", "4", "--kv-dtype", "float16"], "float16"),
                              ("f32", ["--bits", "8", "--kv-dtype", "float32"], "float32")):
        assert main(["quantize", src, "-o", str(tmp_path / name), *flags, "--no-progress", "--no-check"]) == 0
        assert read_manifest(tmp_path / name).kv_dtype == want, flags  # the default at this max_seq: fp32
    capsys.readouterr()
    assert main(["info", str(tmp_path / "int8")]) == 0
    out = capsys.readouterr().out
    assert "kv_dtype int8," in out and "per decoded token: stack_lone.decode + head.decode" in out
    assert main(["quantize", str(exports["fp32"]), "-o", str(tmp_path / "bad"), "--bits", "8", "--kv-dtype",
                 "fp8"]) == 2
    assert "--kv-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
