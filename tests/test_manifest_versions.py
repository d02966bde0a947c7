"""Manifest versions: formats 1-7 refused with one line, format 8 read (no paired head), and the fields
formats 8-9 carry (add_bos, kv_head_dim, kv_cache_rows): how each is checked."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from edgellm.cli import main
from edgellm.runtime.manifest import MANIFEST, read_manifest
from tests.test_manifest import CONFIG, edit, make_export, rejects


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6, 7])
def test_older_formats_get_one_re_export_line(tmp_path: Path, version: int) -> None:
    """Formats 1-7 (older edgellm releases) are refused by version before any key is read: one line naming the
    file, the version and what to do."""
    make_export(tmp_path)
    edit(tmp_path, lambda d: (d.update(format_version=version), d.pop("kv_head_dim"), d.pop("eos_ids")))
    rejects(tmp_path, rf"^{re.escape(str(tmp_path / MANIFEST))}: format {version} was written by an older "
                      r"edgellm; re-export with this version \(reads 8-16\)$")


def test_the_cli_prints_the_re_export_line_and_exits_2(tmp_path: Path, capsys) -> None:
    make_export(tmp_path)
    edit(tmp_path, lambda d: d.update(format_version=7))
    assert main(["run", str(tmp_path), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"edgellm run: error: {tmp_path / MANIFEST}: format 7 was written by an older edgellm; "
                   "re-export with this version (reads 8-16)\n")


def test_add_bos_round_trips(tmp_path: Path) -> None:
    written = make_export(tmp_path)
    edit(tmp_path, lambda d: d["tokenizer"].update(add_bos=False))
    got = read_manifest(tmp_path)
    assert got.add_bos is False and got.to_json() == dataclasses.replace(
        written, tokenizer={**written.tokenizer, "add_bos": False}).to_json()
    assert json.loads(got.to_json())["tokenizer"]["add_bos"] is False


def test_kv_head_dim_sizes_the_cache(tmp_path: Path) -> None:
    """Format 7's kv_head_dim (zero-padded heads, export/fused.py) is the cache row width the graphs and the
    runtime use; the model's head_dim stays the config's. A format-6 manifest has no key: rows are head_dim wide."""
    written = make_export(tmp_path / "pad", kv_layout="inplace", kv_head_dim=8)
    got = read_manifest(tmp_path / "pad")
    assert got == written and (got.kv_head_dim, got.head_dim, got.model_head_dim) == (8, 8, 4)
    assert got.graph("layer", 1, 0).inputs[3].shape == (1, 2, 17, 8)  # max_seq + the spare row (format 10)
    edit(tmp_path / "pad", lambda d: d.update(kv_head_dim=None))  # the graphs' caches no longer match
    rejects(tmp_path / "pad", r"past_key\.0: expected \[1, 2, 17, 4\] float32, got \[1, 2, 17, 8\]")
    for bad in (3, 13):
        edit(tmp_path / "pad", lambda d, bad=bad: d.update(kv_head_dim=bad))
        rejects(tmp_path / "pad", f"kv_head_dim: expected an integer from the model's head_dim 4 to 12, got {bad}")
    edit(tmp_path / "pad", lambda d: d.update(kv_head_dim=8, kv_layout="rows"))
    rejects(tmp_path / "pad", "kv_head_dim: zero-padded heads exist in kv_layout 'inplace' only")


def test_kv_cache_rows_size_the_sliding_layers(tmp_path: Path) -> None:
    """Format 8's kv_cache_rows: a sliding-window layer's cache is a ring of min(window, max_seq) rows ("rows"), its graph
    I/O that size; the list must be what the config implies."""
    sliding = {**CONFIG, "layer_types": ["sliding", "full"], "sliding_window": 6}
    written = make_export(tmp_path / "ring", config=sliding)
    got = read_manifest(tmp_path / "ring")
    assert got == written and got.kv_cache_rows == (6, 16) and got.dims.rows == (6, 16)
    assert got.graph("layer", 1, 0).inputs[3].shape == (1, 2, 6, 4)
    assert got.graph("layer", 1, 1).inputs[3].shape == (1, 2, 16, 4)
    edit(tmp_path / "ring", lambda d: d.update(kv_cache_rows=None))
    rejects(tmp_path / "ring", r"kv_cache_rows: expected \[6, 16\]")
    edit(tmp_path / "ring", lambda d: d.update(kv_cache_rows=[8, 16]))
    rejects(tmp_path / "ring", r"kv_cache_rows: expected \[6, 16\]")
    # fused layers write a chunk before reading the ring: window + prefill_chunk - 1 rows
    edit(tmp_path / "ring", lambda d: d.update(kv_cache_rows=[6, 16], kv_layout="inplace"))
    rejects(tmp_path / "ring", r"kv_cache_rows: expected \[9, 17\]")  # + the full layer's spare row


def test_format_8_reads_without_a_paired_head(tmp_path: Path) -> None:
    """Format 8 (the previous one) reads as it was written; a paired head (head.onnx) came with format 9."""
    written = make_export(tmp_path)
    edit(tmp_path, lambda d: (d.update(format_version=8), d.pop("logit_columns"), d.pop("kv_dtype")))  # 12's, 14's
    assert read_manifest(tmp_path) == dataclasses.replace(written, format_version=8)
    edit(tmp_path, lambda d: [g.update(paired=True) for g in d["graphs"] if g["role"] == "head"])
    rejects(tmp_path, "graphs: a paired head needs format_version 9, this manifest says 8")


def test_format_10_inplace_caches_have_the_spare_row(tmp_path: Path) -> None:
    """Format 10: an "inplace" export's full-attention caches hold max_seq + 1 rows (fused attention's extra row,
    graphio.SPARE_ROWS); a format-9 one has max_seq rows and still reads; each is refused with the other's."""
    new = make_export(tmp_path / "10", kv_layout="inplace")
    old = make_export(tmp_path / "9", kv_layout="inplace", version=9)
    assert read_manifest(tmp_path / "10") == new and read_manifest(tmp_path / "9") == old
    assert new.graph("layer", 1, 0).inputs[3].shape == (1, 2, 17, 4) and new.dims.all_rows == (17, 17)
    assert old.graph("layer", 1, 0).inputs[3].shape == (1, 2, 16, 4) and old.dims.all_rows == (16, 16)
    assert make_export(tmp_path / "rows").dims.all_rows == (16, 16)  # "rows" layers: no extra row
    edit(tmp_path / "9", lambda d: d.update(format_version=10))
    rejects(tmp_path / "9", r"past_key\.0: expected \[1, 2, 17, 4\] float32, got \[1, 2, 16, 4\]")
