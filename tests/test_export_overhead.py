"""What an export stores besides weights (issue 22): one copy of each RoPE table for all layers (rope.data), in the
fp32 export and in what `edgellm quantize` writes from it, and tokenizer.json minified (merges as "a b" strings)
to the same ids."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from edgellm.export import ExportOptions, export_model
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.tokenizer import copy_tokenizer, load_tokenizer
from tests.export_helpers import onnx_generate_logits, tiny_model, torch_logits
from tests.quant_helpers import quantize
from tests.test_export import externals, load_graph

OPTIONS = ExportOptions(max_seq=48, prefill_chunk=8)


def rope_refs(directory: Path) -> tuple[set[tuple[str, int]], list[str]]:
    """((data file, offset) of every RoPE table any graph reads, names of RoPE tables stored inside a graph)."""
    refs, inline = set(), []
    for f in sorted(directory.glob("*.onnx")):
        graph = load_graph(f)
        ext = externals(graph)
        for t in graph.graph.initializer:
            if ".rope." in t.name:
                if t.name in ext:
                    refs.add(ext[t.name][:2])
                else:
                    inline.append(f"{f.name}:{t.name}")
    return refs, inline


# tables per model: llama2 (cos, sin), stellarbyte's XPos (q_cos, q_sin, k_cos, k_sin), gemma3 a global and a
# sliding-window (local) pair
@pytest.mark.parametrize(("preset", "tables"), [("llama2", 2), ("stellarbyte", 4), ("gemma3", 4)])
def test_rope_tables_are_stored_once_in_export_and_quantize(tmp_path, preset, tables):
    model = tiny_model(preset, seed=1, n_layers=3)
    fp32 = tmp_path / "fp32"
    export_model(model, fp32, OPTIONS, progress=False, log=lambda _: None)
    outputs = [fp32, quantize(fp32, tmp_path / "int4", bits=4), quantize(fp32, tmp_path / "int8", bits=8)]
    for out in outputs:
        refs, inline = rope_refs(out)
        assert not inline and {file for file, _ in refs} == {"rope.data"} and len(refs) == tables, (out, refs)
        m = read_manifest(out, verify=True)
        assert "rope.data" in m.files and all(g.data != "rope.data" for g in m.graphs)
    size = (fp32 / "rope.data").stat().st_size
    assert all((out / "rope.data").stat().st_size == size for out in outputs)
    tokens = list(range(3, 14))
    got, generated = onnx_generate_logits(fp32, tokens, 3)
    assert np.abs(got - torch_logits(model, tokens + generated)).max() < 1e-4
    got4, _ = onnx_generate_logits(outputs[1], tokens, 3)
    assert np.isfinite(got4).all()


def test_an_interrupted_export_resumes_with_the_same_rope_tables(tmp_path, monkeypatch):
    """rope.data is written again on a resume; the same bytes keep the layers already recorded valid."""
    import edgellm.export.exporter as exporter

    model = tiny_model("llama2", seed=2, n_layers=3)
    real, calls = exporter.export_unit, []

    def interrupted(*args, **kwargs):
        if len(calls) == 3:  # head, embed, layer_0
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)
    with monkeypatch.context() as mp:
        mp.setattr(exporter, "export_unit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export_model(model, tmp_path / "out", OPTIONS, progress=False, log=lambda _: None)
    log: list[str] = []
    export_model(model, tmp_path / "out", OPTIONS, progress=False, log=log.append)
    assert "reusing layer_0 (checksums match)" in log
    refs, inline = rope_refs(tmp_path / "out")
    assert not inline and {file for file, _ in refs} == {"rope.data"} and len(refs) == 2


def bpe_tokenizer(path: Path) -> None:
    """A byte-level BPE trained on non-ASCII text, saved pretty-printed as transformers saves one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["héllo wörld, naïve café — 日本語のテキスト", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path), pretty=True)


def test_tokenizer_json_ships_minified_with_the_same_ids(tmp_path):
    bpe_tokenizer(tmp_path / "tokenizer.json")
    model = tiny_model("llama2", seed=3, vocab_size=320)
    export_model(model, tmp_path / "fp32", OPTIONS, tokenizer=tmp_path / "tokenizer.json", progress=False,
                 log=lambda _: None)
    quantize(tmp_path / "fp32", tmp_path / "int8", bits=8)
    source = (tmp_path / "tokenizer.json").read_bytes()
    text = "héllo wörld — the lazy café 日本 fox"
    want = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json")).encode(text)
    merged = json.loads(source)  # the merges as "a b" strings, all the rest as it was
    merged["model"]["merges"] = [" ".join(pair) for pair in merged["model"]["merges"]]
    for out in (tmp_path / "fp32", tmp_path / "int8"):
        packed = (out / "tokenizer.json.xz").read_bytes()  # format 11: xz-compressed
        shipped = lzma.decompress(packed)
        assert json.loads(shipped) == merged and len(shipped) < 0.8 * len(source) and len(packed) < 0.5 * len(shipped)
        assert b"\n" not in shipped and "Ġ".encode() in shipped  # no indentation, no \\u escapes
        (tmp_path / "unpacked.json").write_bytes(shipped)
        assert transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "unpacked.json")).encode(text) == want
        assert load_tokenizer(out / "tokenizer.json.xz", 320).encode(text) == want
        read_manifest(out, verify=True)  # its checksum is the packed file's


def test_copy_tokenizer_keeps_escapes_a_lone_surrogate_needs_and_merges_with_spaces(tmp_path):
    (tmp_path / "in.json").write_text('{\n  "a": "\\ud800",\n  "model": {"type": "BPE", "merges": [["a b", "c"]]}\n}')
    copy_tokenizer(tmp_path / "in.json", tmp_path / "out.json", "hf")
    assert (tmp_path / "out.json").read_text() == '{"a":"\\ud800","model":{"type":"BPE","merges":[["a b","c"]]}}'
