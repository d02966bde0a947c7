"""`--lm-head-int8-rows`: the lm_head split by vocabulary rows into an int8 and an int4 part (quant/headsplit.py),
checked against its definition and, through onnxruntime, against the unsplit graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from edgellm.cli import main
from edgellm.quant.headsplit import choose_rows, part_name, row_importance, split_head, split_order
from edgellm.quant.nbits_read import read_nbits
from edgellm.quant.packing import from_matmulnbits
from edgellm.quant.schemes import Scheme, dequantize, quantize
from edgellm.runtime.manifest import FORMAT_VERSION, read_manifest
from tests.quant_helpers import export
from tests.quant_helpers import quantize as quantize_export


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("tied"), "from-scratch", "layer")[1]


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("untied"), "llama2", "layer")[1]


def test_row_importance_is_its_definition() -> None:
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(7, 32)).astype(np.float32), rng.normal(size=(20, 32)).astype(np.float32)
    low = Scheme(4, 16, True)
    logits = x @ w.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = x @ (w - dequantize(quantize(w, low))).T          # every row's logit error at every input
    want = (p * d * d).sum(0)
    got = row_importance(x, w, low, chunk=6)               # chunks that do not divide V
    np.testing.assert_allclose(got, want, rtol=1e-5)
    hi = choose_rows(got, 0.25)
    assert hi.sum() == 5 and set(np.flatnonzero(hi)) == set(np.argsort(-want)[:5])
    assert choose_rows(np.zeros(4), 0.5).tolist() == [True, True, False, False]      # ties: lower ids first
    assert choose_rows(got, 0.001).sum() == 1 and choose_rows(got, 0.999).sum() == 19   # both parts exist


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def load(path: Path) -> onnx.ModelProto:
    return onnx.load(path, load_external_data=True)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_split_fp32_graphs_compute_the_same_logits_and_rows(which, tied, untied) -> None:
    src = tied if which == "tied" else untied
    m = read_manifest(src)
    table = "embed.weight" if m.config.get("tie_embeddings") else "lm_head.weight"
    head = load(src / m.graph("head", m.prefill_chunk).file)
    v = m.config["vocab_size"]
    hi = np.random.default_rng(1).random(v) < 0.3
    split = onnx.ModelProto()
    split.CopyFrom(head)
    assert split_head(split, table, hi)
    assert {t.name for t in split.graph.initializer} >= {part_name(table, "hi"), part_name(table, "lo")}
    assert table not in {t.name for t in split.graph.initializer}
    h = np.random.default_rng(2).normal(size=(1, m.prefill_chunk, m.config["dim"])).astype(np.float32)
    want, got = (session(g).run(["logits"], {"hidden": h})[0] for g in (head, split))
    columns = split_order(hi)                             # the split head's logits: hi rows' ids, then lo rows'
    assert sorted(columns[:hi.sum()]) == list(columns[:hi.sum()]) and set(columns[:hi.sum()]) == set(np.flatnonzero(hi))
    np.testing.assert_allclose(got, want[..., columns], rtol=0, atol=1e-5)
    assert (columns[got.argmax(-1)] == want.argmax(-1)).all()
    if which == "tied":                                   # the lookup: the very rows, from either part
        embed = load(src / m.graph("embed", m.prefill_chunk).file)
        assert split_head(embed, table, hi)
        ids = np.array([[0, 1, int(np.flatnonzero(hi)[-1]), int(np.flatnonzero(~hi)[0]), 5, 6, 7, v - 1]],
                       np.int64)[:, : m.prefill_chunk]
        original = load(src / m.graph("embed", m.prefill_chunk).file)
        want, got = (session(g).run(["hidden"], {"tokens": ids})[0] for g in (original, embed))
        assert np.array_equal(got, want)


def part_tables(head: onnx.GraphProto) -> dict[int, np.ndarray]:
    """{bits: the dequantized [N, D] table} of the head's MatMulNBits parts."""
    return {arr.bits: dequantize(from_matmulnbits(arr))
            for arr in (read_nbits(head, n) for n in head.node if n.op_type == "MatMulNBits")}


def test_quantized_split_head_is_two_kernels_and_one_shared_copy(tied, tmp_path, capsys) -> None:
    whole = quantize_export(tied, tmp_path / "whole", bits=4, lm_head="int8", calibration_tokens=64)
    out = quantize_export(tied, tmp_path / "split", bits=4, lm_head="int8", head_int8_rows=0.25,
                          calibration_tokens=64)
    m = read_manifest(out)
    v, d = m.config["vocab_size"], m.config["dim"]
    w = m.quantization["weights"]
    assert (w["lm_head.hi.weight"]["bits"], w["lm_head.lo.weight"]["bits"]) == (8, 4)
    assert w["lm_head.hi.weight"]["shape"][0] == round(0.25 * v)
    assert w["embed.hi.weight"]["shared_with"] == "lm_head" and w["embed.lo.weight"]["shared_with"] == "lm_head"
    assert m.quantization["options"]["head_int8_rows"] == 0.25
    head = load(out / m.graph("head", 1).file).graph
    parts = part_tables(head)
    assert sorted(parts) == [4, 8]
    assert m.format_version == FORMAT_VERSION and m.logit_columns == "logit_columns.i32"
    columns = np.fromfile(out / m.logit_columns, "<i4")                # the head's column -> token id
    assert sorted(columns) == list(range(v))
    table = np.empty((v, d), np.float32)
    table[columns] = np.concatenate([parts[8], parts[4]])               # [V, D] in vocabulary order
    # one copy: the lookup reads the head's codes (bit-identical rows), and the file shrank by the int4 rows
    model = load(out / "embed.decode.onnx")
    lookup = session(model)
    for token in (0, 3, v - 1):
        row = lookup.run(["hidden"], {"tokens": np.array([[token]], np.int64)})[0].reshape(-1)
        assert np.array_equal(row, table[token])
    data = m.graph("head", 1).data                                     # the table's one copy lives there
    assert data == read_manifest(whole).graph("head", 1).data == m.graph("embed", 1).data
    # int8 g32 (fp16 scales) vs int4 g32 (float32 scales: --scales-dtype auto), less the lookup's int32 row positions
    saved = 0.75 * v * d * (8.5 - 5.0) / 8 - 4 * v
    assert (whole / data).stat().st_size - (out / data).stat().st_size >= saved
    assert main(["info", str(out)]) == 0
    assert "lm_head int8 (25% of its rows, the rest int4)" in capsys.readouterr().out


def test_untied_head_splits_and_keep_lm_head_leaves_it_whole(untied, tmp_path) -> None:
    out = quantize_export(untied, tmp_path / "split", bits=4, lm_head="int8", head_int8_rows=0.5,
                          calibration_tokens=64)
    m = read_manifest(out)
    w = m.quantization["weights"]
    assert (w["lm_head.hi.weight"]["bits"], w["lm_head.lo.weight"]["bits"]) == (8, 4) and "lm_head.weight" not in w
    head = load(out / m.graph("head", 1).file).graph
    assert sorted(part_tables(head)) == [4, 8] and m.logit_columns is not None
    assert "GatherElements" not in {n.op_type for n in head.node}     # the runtime reads the columns
    kept = quantize_export(untied, tmp_path / "kept", bits=4, lm_head="int8", head_int8_rows=0.5,
                           keep=("lm_head",), calibration_tokens=64)
    w = read_manifest(kept).quantization["weights"]
    assert w["lm_head.weight"]["format"] == "fp32" and not any(".hi." in k or ".lo." in k for k in w)
    assert read_manifest(kept).logit_columns is None


def test_generation_reads_the_split_columns_as_vocabulary_logits(tied, tmp_path) -> None:
    """The runtime picks from the head's split-order columns (Engine.columns, format 12): greedy tokens, with
    speculation off and on, are those of argmax over the vocabulary-order logits `Engine.forward` returns,
    and the tokens of the same head restored in the graph (format 11's GatherElements) match them."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.sampling import SamplingParams, StopParams

    out = quantize_export(tied, tmp_path / "split", bits=4, lm_head="int8", head_int8_rows=0.3,
                          calibration_tokens=64)
    m = read_manifest(out)
    engine = Engine.open(out, m)
    assert not engine.columns.identity and len(engine.columns.runs) == 2
    prompt = [1, 5, 9, 3, 7, 5, 9]
    want, logits = [], engine.forward(prompt)
    for _ in range(20):
        want.append(int(np.argmax(logits)))
        raw = engine.forward_columns([want[-1]])
        logits = engine.columns.vocab(raw)
        assert np.array_equal(raw, logits[engine.columns.ids])
    gen = Generator.open(out)
    for mode in ("off", "lookup"):
        gen.speculate(mode)
        got = gen.complete(prompt, SamplingParams(temperature=0), StopParams(20), ignore_eos=True, text=False)
        assert got.token_ids == want, mode
    # the same graphs with the order restored inside the head (what format 11 did): the same logits
    head = load(out / m.graph("head", 1).file)
    concat = next(n for n in head.graph.node if n.op_type == "Concat")
    logits_in_order = concat.output[0]
    concat.output[0] = "split_order"
    pos = numpy_helper.from_array(np.argsort(engine.columns.ids).astype(np.int64)[None, :], "pos")
    head.graph.initializer.append(pos)
    head.graph.node.extend([onnx.helper.make_node("Shape", ["split_order"], ["shape"]),
                            onnx.helper.make_node("Expand", ["pos", "shape"], ["index"]),
                            onnx.helper.make_node("GatherElements", ["split_order", "index"], [logits_in_order],
                                                  axis=-1)])
    h = np.random.default_rng(3).normal(size=(1, 3, m.config["dim"])).astype(np.float32)
    raw = session(load(out / m.graph("head", 1).file)).run(["logits"], {"hidden": h})[0]
    restored = session(head).run(["logits"], {"hidden": h})[0]
    assert np.array_equal(engine.columns.vocab(raw), restored)
