"""Reading older manifest formats, and the fields each format added (eos_ids/chat template 6, add_bos and
kv_head_dim 7, kv_cache_rows 8): what an old export reads as, and how a new field is checked."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from edgellm.runtime.manifest import read_manifest
from tests.test_manifest import CONFIG, edit, make_export, rejects


def test_version_5_reads_with_one_eos_id_and_no_chat_template(tmp_path: Path) -> None:
    """Format 6 added eos_ids and tokenizer.chat_template: a format-5 manifest has neither key."""
    make_export(tmp_path)
    edit(tmp_path, lambda d: (d.update(format_version=5), d.pop("eos_ids"), d["tokenizer"].pop("chat_template"),
                              d["tokenizer"].pop("add_bos")))
    got = read_manifest(tmp_path)
    assert (got.eos_id, got.eos_ids, got.tokenizer["chat_template"]) == (2, (2,), None)
    edit(tmp_path, lambda d: d.update(eos_id=None))
    assert read_manifest(tmp_path).eos_ids == ()


def test_version_6_reads_add_bos_from_bos_id(tmp_path: Path) -> None:
    """Format 7 added tokenizer.add_bos; formats 1-6 put BOS in front of text whenever there was a bos_id."""
    make_export(tmp_path)
    edit(tmp_path, lambda d: (d.update(format_version=6), d["tokenizer"].pop("add_bos")))
    got = read_manifest(tmp_path)
    assert got.tokenizer["add_bos"] is True and got.add_bos
    edit(tmp_path, lambda d: d.update(bos_id=None))
    assert read_manifest(tmp_path).add_bos is False
    edit(tmp_path, lambda d: (d.update(bos_id=1), d["tokenizer"].update(add_bos=False)))
    assert read_manifest(tmp_path).add_bos is True  # format 6's rule, whatever the (unknown to it) key says


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
    assert got.graph("layer", 1, 0).inputs[3].shape == (1, 2, 16, 8)
    edit(tmp_path / "pad", lambda d: d.update(kv_head_dim=None))  # the graphs' caches no longer match
    rejects(tmp_path / "pad", r"past_key\.0: expected \[1, 2, 16, 4\] float32, got \[1, 2, 16, 8\]")
    for bad in (3, 13):
        edit(tmp_path / "pad", lambda d, bad=bad: d.update(kv_head_dim=bad))
        rejects(tmp_path / "pad", f"kv_head_dim: expected an integer from the model's head_dim 4 to 12, got {bad}")
    edit(tmp_path / "pad", lambda d: d.update(kv_head_dim=8, kv_layout="rows"))
    rejects(tmp_path / "pad", "kv_head_dim: zero-padded heads exist in kv_layout 'inplace' only")
    make_export(tmp_path / "v6", kv_layout="inplace")
    edit(tmp_path / "v6", lambda d: (d.update(format_version=6), d.pop("kv_head_dim")))
    got = read_manifest(tmp_path / "v6")
    assert (got.kv_head_dim, got.head_dim, got.model_head_dim) == (None, 4, 4)


def test_kv_cache_rows_size_the_sliding_layers(tmp_path: Path) -> None:
    """Format 8's kv_cache_rows: a sliding-window layer's cache is a ring of min(window, max_seq) rows ("rows"), its graph
    I/O that size; the list must be what the config implies; a format-7 manifest reads as null (max_seq rows)."""
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
    rejects(tmp_path / "ring", r"kv_cache_rows: expected \[9, 16\]")
    make_export(tmp_path / "v7")
    edit(tmp_path / "v7", lambda d: (d.update(format_version=7), d.pop("kv_cache_rows")))
    assert read_manifest(tmp_path / "v7").kv_cache_rows is None


def test_version_1_reads_as_the_rows_layout(tmp_path: Path) -> None:
    """Exports written before kv_layout existed (format_version 1, no key) still load, as "rows"."""
    make_export(tmp_path)
    edit(tmp_path, lambda d: (d.update(format_version=1), d.pop("kv_layout"), [g.pop("paired") for g in d["graphs"]]))
    assert read_manifest(tmp_path).kv_layout == "rows"


def test_version_2_reads_as_unpaired(tmp_path: Path) -> None:
    """Version 2 had no `paired` key: every graph reads as one file per variant."""
    make_export(tmp_path, kv_layout="inplace")
    edit(tmp_path, lambda d: (d.update(format_version=2), [g.pop("paired") for g in d["graphs"]]))
    assert not any(g.paired for g in read_manifest(tmp_path).graphs)
