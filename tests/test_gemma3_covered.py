"""Gemma 3 sliding-window layers with full-length caches (manifest format 16): a window that covers the export's
max_seq never masks a position, so the fused export runs those layers as full ones through GroupQueryAttention
(their own RoPE table) with the spare row, instead of rings in standard ops; `--sliding-cache full` does so for any
window, the kernel's local_window_size applying it. Exact against transformers past the window, and, no cache
being a ring, greedy speculation runs on them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from edgellm.export import ExportOptions, export_model
from edgellm.loaders import load_checkpoint
from edgellm.model import ModelConfig
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.graphio import SPARE_ROWS
from edgellm.runtime.manifest import COVER_SINCE, FORMAT_VERSION, read_manifest
from tests.export_helpers import assert_exact_speculation, engine_greedy
from tests.test_gemma3 import OPTIONS, PROMPT, STEPS, WINDOW, hf_logits, prompt_ids, save_gemma

pytest.importorskip("transformers")
MAX_SEQ = OPTIONS["max_seq"]


def _export(tmp_path, window: int, sliding_cache: str = "ring"):
    hf = save_gemma(tmp_path / "hf", sliding_window=window)
    export_model(load_checkpoint(tmp_path / "hf").model, tmp_path / "fp32",
                 ExportOptions(**OPTIONS, sliding_cache=sliding_cache), progress=False)
    return hf, tmp_path / "fp32"


def _nodes(path) -> list[onnx.NodeProto]:
    return list(onnx.load(path, load_external_data=False).graph.node)


def _ops(path) -> set[str]:
    return {n.op_type for n in _nodes(path)}


def _local_windows(path) -> list[int]:
    return [a.i for n in _nodes(path) if n.op_type == "GroupQueryAttention" for a in n.attribute
            if a.name == "local_window_size"]


def _assert_greedy_like_transformers(hf, out) -> None:
    got, generated, cache = engine_greedy(out, prompt_ids(), STEPS)
    assert not any(cache.ring) and cache.can_rewind(PROMPT)
    want = hf_logits(hf, prompt_ids() + generated)[PROMPT - 1:]
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    assert want[:-1].argmax(-1).tolist() == generated
    # no ring: greedy lookup speculation runs (a ring cache turns it off) and keeps plain decoding's tokens
    assert_exact_speculation(out, prompt_ids() * 2)


@pytest.fixture(scope="module")
def covered(tmp_path_factory):
    """A seeded Gemma whose window (64) covers max_seq (64), exported once for this module."""
    return _export(tmp_path_factory.mktemp("covered"), MAX_SEQ)


def test_a_covering_window_exports_full_layers_equal_to_transformers(covered):
    hf, out = covered
    m = read_manifest(out)
    assert m.format_version == COVER_SINCE
    assert m.kv_cache_rows == (MAX_SEQ + SPARE_ROWS,) * 4          # every layer a full one, with the spare row
    assert "sliding-window layers too" in m.export_options["attention_impl"]
    ops = _ops(out / "layer_0.decode.onnx")                                 # layer 0 is a sliding one
    assert "GroupQueryAttention" in ops and "ScatterElements" not in ops
    assert _local_windows(out / "layer_0.decode.onnx") == []       # a covering window masks nothing
    _assert_greedy_like_transformers(hf, out)


def test_sliding_cache_full_applies_the_window_in_the_fused_kernel(tmp_path):
    """Window 8 at max_seq 64: 41 positions deep, five windows past the first, the kernel's local window equals
    the model's mask (keys with q - p < window), and the manifest says which cache the sliding layers keep."""
    hf, out = _export(tmp_path, WINDOW, "full")
    m = read_manifest(out)
    assert (m.format_version, m.sliding_cache) == (COVER_SINCE, "full")
    assert m.kv_cache_rows == (MAX_SEQ + SPARE_ROWS,) * 4
    assert "full-length caches, local_window_size 8" in m.export_options["attention_impl"]
    assert _local_windows(out / "layer_0.decode.onnx") == [WINDOW] and _local_windows(out / "layer_2.decode.onnx") == []
    assert "ScatterElements" not in _ops(out / "layer_0.decode.onnx")
    _assert_greedy_like_transformers(hf, out)
    path = out / "manifest.json"                                     # the same export read as rings: refused
    path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_cache": "ring"}))
    with pytest.raises(EdgeError, match=r"kv_cache_rows: expected \[15, 15, 65, 15\]"):
        read_manifest(out)


def test_sliding_cache_full_is_refused_where_no_fused_layer_writes_it() -> None:
    with pytest.raises(EdgeError, match=r"^--sliding-cache full: written by the fused layers only"):
        ExportOptions(attention="standard", sliding_cache="full").validate()
    with pytest.raises(EdgeError, match=r"^--sliding-cache: expected one of ring, full, got 'half'"):
        ExportOptions(sliding_cache="half").validate()


def test_a_window_one_short_of_max_seq_keeps_its_ring(tmp_path):
    _, out = _export(tmp_path, MAX_SEQ - 1)
    m = read_manifest(out)
    ring = MAX_SEQ - 1 + OPTIONS["prefill_chunk"] - 1
    assert m.format_version == FORMAT_VERSION and m.kv_cache_rows == (min(ring, MAX_SEQ),) * 2 + (
        MAX_SEQ + SPARE_ROWS, min(ring, MAX_SEQ))
    assert "ScatterElements" in _ops(out / "layer_0.decode.onnx")


def test_an_older_version_on_a_covered_export_fails_on_its_cache_rows(covered, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(covered[1], out)                                 # edited below: the shared export stays whole
    path = out / "manifest.json"
    doc = json.loads(path.read_text())
    older = {k: v for k, v in doc.items() if k != "sliding_cache"}  # 15 has no such key
    path.write_text(json.dumps({**older, "format_version": 15}))
    with pytest.raises(EdgeError, match=r"kv_cache_rows: expected \[64, 64, 65, 64\]"):
        read_manifest(out)
    path.write_text(json.dumps({**doc, "format_version": COVER_SINCE + 1}))
    with pytest.raises(EdgeError, match=r"format_version 17 is not supported \(this edgellm reads 8-16"):
        read_manifest(out)


def test_an_fp16_cache_is_refused_only_where_a_ring_stays() -> None:
    gemma = ModelConfig.preset_config("gemma3", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=256,
                                      hidden_dim=128, max_seq_len=128, sliding_window=64)
    ExportOptions(max_seq=64, kv_dtype="float16").validate(gemma)    # the window covers max_seq: full layers
    ExportOptions(max_seq=65, kv_dtype="float16", sliding_cache="full").validate(gemma)
    with pytest.raises(EdgeError, match=r"^--kv-dtype float16: sliding-window layers shorter than --max-seq"):
        ExportOptions(max_seq=65, kv_dtype="float16").validate(gemma)
