"""An fp16 KV cache (`export --kv-dtype float16`, manifest format 14 `kv_dtype`): the fused layers cast
GroupQueryAttention's inputs to fp16 and its output back, the runtime allocates the cache fp16 (half the bytes),
the logits stay within the fp16 tolerance of PyTorch's, greedy speculation stays bit for bit plain decoding (fp32
and int4 weights, the lone-row stack too), quantize keeps the cache type or makes an fp32 one fp16 (its
default from max_seq 1536 on: quant/kv_cache.FP16_MIN_SEQ), and what cannot hold one is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.export import ExportOptions, export_model
from edgellm.model import ModelConfig
from edgellm.quant.kv_cache import FP16_MIN_SEQ
from edgellm.runtime.engine import Engine
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.generator import Generator
from edgellm.runtime.graphio import FP16_CACHE_ATOL
from edgellm.runtime.manifest import Manifest, read_manifest
from edgellm.runtime.sampling import SamplingParams, StopParams
from edgellm.runtime.session import SessionConfig
from tests.export_helpers import assert_exact_speculation, tiny_model
from tests.quant_helpers import quantize

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 256, 10)] * 3
GREEDY = SamplingParams(temperature=0)


def export(out: Path, kv_dtype: str, preset: str = "llama2", max_seq: int = 96,
           **over) -> tuple[Path, torch.nn.Module]:
    model = tiny_model(preset, seed=0, **over)
    export_model(model, out, ExportOptions(max_seq=max_seq, prefill_chunk=8, kv_dtype=kv_dtype), progress=False,
                 log=lambda _: None)
    return out, model


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("kv16")
    return {dt: export(root / dt, dt) for dt in ("float32", "float16")}


def test_an_fp16_cache_halves_the_cache_and_stays_within_fp16_of_pytorch(exports) -> None:
    (d16, model), (d32, _) = exports["float16"], exports["float32"]
    m16, m32 = read_manifest(d16), read_manifest(d32)
    assert (m16.kv_dtype, m16.format_version, m32.kv_dtype) == ("float16", 14, "float32")
    assert all(t.dtype == "float16" for g in m16.graphs for t in (*g.inputs, *g.outputs)
               if t.name.startswith(("past_", "present_")))
    g16, g32 = Generator.open(d16), Generator.open(d32)
    assert {a.dtype for a in g16.cache.keys + g16.cache.values} == {np.dtype(np.float16)}
    assert sum(a.nbytes for a in g16.cache.keys) * 2 == sum(a.nbytes for a in g32.cache.keys)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT]))[0][0].numpy()
    got = Engine.open(d16, m16).forward_rows(PROMPT)
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert 0 < err <= FP16_CACHE_ATOL  # fp16 rows: not the fp32 export's ~1e-6, within the export's bound
    assert m16.verification["end_to_end"] <= FP16_CACHE_ATOL


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_greedy_speculation_stays_exact_with_an_fp16_cache(exports, tmp_path: Path, weights: str) -> None:
    d16 = exports["float16"][0]
    out = d16 if weights == "fp32" else quantize(d16, tmp_path / "int4", bits=4, method="rtn")
    assert read_manifest(out).kv_dtype == "float16"  # quantize keeps the cache type
    assert assert_exact_speculation(out, PROMPT).stack_role == "stack"


def test_the_lone_row_stack_reads_an_fp16_cache(exports) -> None:
    d16 = exports["float16"][0]
    lone = Generator.open(d16, config=SessionConfig(exact=False))
    assert lone.engine.stack_role == "stack_lone" and lone.cache.keys[0].dtype == np.float16
    r = lone.complete(PROMPT, SamplingParams(temperature=0.8), StopParams(16, seed=1), ignore_eos=True, text=False)
    assert len(r.token_ids) == 16


def test_what_cannot_hold_an_fp16_cache_is_refused() -> None:
    with pytest.raises(EdgeError, match=r"^--kv-dtype float16: written by the fused layers only"):
        ExportOptions(attention="standard", kv_dtype="float16").validate()
    with pytest.raises(EdgeError, match=r"^--kv-dtype: expected one of float32, float16, got 'bfloat16'"):
        ExportOptions(kv_dtype="bfloat16").validate()
    gemma = ModelConfig.preset_config("gemma3", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=256,
                                      hidden_dim=128, max_seq_len=128)
    with pytest.raises(EdgeError, match=r"^--kv-dtype float16: sliding-window layers .* keep float32 caches"):
        ExportOptions(max_seq=96, kv_dtype="float16").validate(gemma)


def test_the_manifest_versions_its_cache_type(exports) -> None:
    doc = json.loads((exports["float16"][0] / "manifest.json").read_text())
    assert doc["kv_dtype"] == "float16"
    Manifest.from_json(json.dumps(doc))  # as written: reads
    for change, message in (
            ({"kv_dtype": "bfloat16"}, r"^kv_dtype: expected one of float32, float16, int8, got 'bfloat16'"),
            ({"format_version": 13}, r"unknown key|kv_dtype"),  # 13's keys are exact: no kv_dtype
    ):
        with pytest.raises(EdgeError, match=message):
            Manifest.from_json(json.dumps({**doc, **change}))
    old = {k: v for k, v in json.loads((exports["float32"][0] / "manifest.json").read_text()).items()
           if k != "kv_dtype"}
    assert Manifest.from_json(json.dumps({**old, "format_version": 13})).kv_dtype == "float32"  # 8-13: fp32


def test_info_prints_the_cache_type_and_its_size(exports, capsys) -> None:
    from edgellm.cli import main

    sizes = {}
    for dtype in ("float32", "float16"):
        assert main(["info", str(exports[dtype][0])]) == 0
        out = capsys.readouterr().out
        assert f"kv_dtype {dtype}," in out
        sizes[dtype] = float(out.split("KV cache ")[1].split(" MB")[0])
        assert f"MB ({dtype}, allocated once" in out
    assert sizes["float16"] * 2 == pytest.approx(sizes["float32"], rel=0.02)


def test_quantize_makes_the_cache_fp16_as_export_does(exports, tmp_path: Path) -> None:
    """`quantize --kv-dtype float16` (and `auto`, the CLI's default, where max_seq >= FP16_MIN_SEQ) on an fp32-cache
    export rewrites the layers' attention as `export --kv-dtype float16` writes it (quant/kv_cache.py): the same
    logits, bit for bit, as quantizing the fp16 export with the same weights; greedy speculation stays exact.
    Under FP16_MIN_SEQ `auto` keeps the fp32 cache (faster at the contexts such an export reaches)."""
    (d16, _), (d32, _) = exports["float16"], exports["float32"]
    rewritten = quantize(d32, tmp_path / "rewritten", bits=4, method="rtn", kv_dtype="float16")
    kept = quantize(d16, tmp_path / "kept", bits=4, method="rtn", kv_dtype="float16")  # already fp16: kept as is
    for d in (rewritten, kept):
        m = read_manifest(d)
        assert (m.kv_dtype, m.format_version) == ("float16", 14)
        assert all(t.dtype == "float16" for g in m.graphs for t in (*g.inputs, *g.outputs)
                   if t.name.startswith(("past_", "present_")))
    rows = {d.name: Engine.open(d, read_manifest(d)).forward_rows(PROMPT) for d in (rewritten, kept)}
    assert np.array_equal(rows["rewritten"], rows["kept"])
    assert assert_exact_speculation(rewritten, PROMPT).stack_role == "stack"
    plain = quantize(d32, tmp_path / "plain", bits=4, method="rtn")  # the API's default: the export's cache
    assert read_manifest(plain).kv_dtype == "float32"
    short = quantize(d32, tmp_path / "short", bits=4, method="rtn", kv_dtype="auto")  # max_seq 96 < FP16_MIN_SEQ
    assert read_manifest(short).kv_dtype == "float32"
    assert np.array_equal(Engine.open(short, read_manifest(short)).forward_rows(PROMPT),
                          Engine.open(plain, read_manifest(plain)).forward_rows(PROMPT))
    long32, _ = export(tmp_path / "long32", "float32", max_seq=FP16_MIN_SEQ, max_seq_len=FP16_MIN_SEQ)
    long16, _ = export(tmp_path / "long16", "float16", max_seq=FP16_MIN_SEQ, max_seq_len=FP16_MIN_SEQ)
    auto = quantize(long32, tmp_path / "auto", bits=4, method="rtn", kv_dtype="auto")
    kept16 = quantize(long16, tmp_path / "kept16", bits=4, method="rtn")
    assert read_manifest(auto).kv_dtype == "float16"
    assert np.array_equal(*(Engine.open(d, read_manifest(d)).forward_rows(PROMPT) for d in (auto, kept16)))


def test_quantize_keeps_a_cache_it_cannot_narrow_and_refuses_to_widen_one(exports, tmp_path: Path) -> None:
    from edgellm.quant.export_dir import quantize_export
    from edgellm.quant.options import QuantizeOptions

    std = tmp_path / "std"
    export_model(tiny_model("llama2", seed=0), std, ExportOptions(max_seq=96, prefill_chunk=8, attention="standard"),
                 progress=False, log=lambda _: None)
    assert read_manifest(quantize(std, tmp_path / "auto", bits=8, kv_dtype="auto")).kv_dtype == "float32"
    for src, dtype, message in ((std, "float16", r"^--kv-dtype float16: .*std: the cache is written by the fused"),
                                (exports["float16"][0], "float32", r"^--kv-dtype float32: .*the export's cache is "
                                                                    r"float16")):
        with pytest.raises(EdgeError, match=message):
            quantize_export(src, tmp_path / "out", QuantizeOptions(bits=8, kv_dtype=dtype), progress=False,
                            log=lambda _: None)
        assert not (tmp_path / "out").exists()
