"""Corrupt exports through the real CLI, every reader: exit code 2, ONE stderr line naming the file, no
traceback, nothing written (the contract of test_reliability_cli.py)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.cli_helpers import (
    copy_with,
    edit_json,
    fails,
    flip,
    reseal,
    tiny_checkpoint,
    truncate,
    truncate_resealed,
)
from tests.runtime_fixtures import bigram_export, tiny_export


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The shared tiny llama2 export: 2 layers, max_seq 64, prefill chunk 8, no tokenizer."""
    return tiny_export(tmp_path_factory, "llama2", "layer")[0]


EXPORT_CASES = {  # id: (edit, text the one line must hold)
    "version": (lambda d: edit_json(d / "manifest.json", lambda m: m.update(format_version=99)),
                "format_version 99 is not supported"),
    "format": (lambda d: edit_json(d / "manifest.json", lambda m: m.update(format="other")), "format: expected"),
    "not-json": (truncate("manifest.json", 0.5), "manifest.json: not valid JSON"),
    "missing-file": (lambda d: (d / "layer_1.data").unlink(), "layer_1.data: listed in files but missing"),
    "sha256": (flip("layer_0.data"), "layer_0.data: sha256 differs from the manifest"),
    "truncated-data": (truncate("head.data", 0.5), "head.data"),
    "onnx-resealed": (truncate_resealed("stack.onnx"), "stack.onnx"),  # the graph run and bench run
    "unknown-key": (lambda d: edit_json(d / "manifest.json", lambda m: m.update(extra=1)), "unknown key(s) ['extra']"),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_corrupt_export_every_reader(tmp_path, tmp_path_factory, capsys, export, case):
    edit, needle = EXPORT_CASES[case]
    bad = copy_with(export, tmp_path / "bad", edit)
    out = tmp_path / "out"
    fails(capsys, ["run", bad, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"], needle)
    fails(capsys, ["bench", bad, "--runs", "1", "--new-tokens", "2"], needle)
    if case == "onnx-resealed":
        return  # see test_corrupt_graph_with_a_valid_manifest_in_quantize_and_diff
    fails(capsys, ["info", bad], needle)             # info reads only the manifest, but checks every file first
    fails(capsys, ["quantize", bad, "-o", out, "--bits", "8", "--no-progress"], needle)
    ckpt = tiny_checkpoint(tmp_path_factory)  # `diff` reads a checkpoint too
    fails(capsys, ["diff", ckpt, bad, "-o", out, "--quiet"], needle)
    assert not out.exists()


def test_corrupt_graph_with_a_valid_manifest_in_quantize(tmp_path, capsys, export):
    bad = copy_with(export, tmp_path / "bad", truncate_resealed("layer_0.decode.onnx"))  # quantize reads layers
    out = tmp_path / "out"
    for argv in (["quantize", bad, "-o", out, "--bits", "8", "--no-progress"],):
        try:
            fails(capsys, argv, "layer_0.decode.onnx")
        except Exception as err:  # a traceback-worthy exception is this test's failure, not a crash
            raise AssertionError(f"{argv[0]}: {type(err).__name__}: {err}") from None
    assert not out.exists()


def test_corrupt_tokenizer_in_an_export(tmp_path, tmp_path_factory, capsys):
    bigram = bigram_export(tmp_path_factory)  # the shared export that carries a tokenizer
    bad = copy_with(bigram, tmp_path / "bad", truncate_resealed("tokenizer.json.xz"))
    fails(capsys, ["run", bad, "--prompt", "a"], "tokenizer.json.xz")
    bad2 = copy_with(bigram, tmp_path / "bad2", flip("tokenizer.json.xz"))  # not resealed: the sha256 catches it
    fails(capsys, ["run", bad2, "--prompt", "a"], "tokenizer.json.xz: sha256 differs")


@pytest.mark.parametrize(("graph", "flags"), [("stack.onnx", ["--temperature", "0"]), ("stack_lone.onnx", [])])
def test_graph_shapes_that_disagree_with_the_manifest(tmp_path, capsys, export, graph, flags):
    """The stack graph `run` runs (greedy: the stack; sampling, the export's default: the lone-row stack)
    declares seqlens_k [2]: sha256 and sizes match (resealed), so only a load-time shape check catches it -
    before a token is printed, naming the graph file."""
    def edit(d: Path) -> None:
        path = d / graph
        model = onnx.load(str(path), load_external_data=False)
        (lengths,) = [i for i in model.graph.input if i.name == "seqlens_k"]
        lengths.type.tensor_type.shape.dim[0].dim_value = 2
        onnx.save(model, str(path))
        reseal(d, graph)

    bad = copy_with(export, tmp_path / "bad", edit)
    fails(capsys, ["run", bad, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", *flags], graph, "seqlens_k")

