"""What `edgellm quantize` lays out for the runtime: pre-packed prefill graphs, paired layers, the stack graph
(embedding + every layer in one session), and how `edgellm info` describes the result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgellm.cli import main
from edgellm.model import Decoder
from edgellm.runtime.manifest import FORMAT_VERSION, read_manifest
from tests.quant_helpers import OPTIONS, export, mapped_kb, quantize


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Decoder, Path]:
    """from-scratch: tied embeddings (the table lives in head.data), interleaved RoPE, in-place layer graphs."""
    return export(tmp_path_factory.mktemp("tied"), "from-scratch", "layer")


def test_quantized_prefill_graphs_are_pre_packed(tied, tmp_path) -> None:
    """MatMulNBits runs many times slower on unpacked weights: a quantized export pre-packs its prefill
    layers too (the fp32 export reads them in place and releases them after each run). A paired (fast)
    export runs both variants of a layer in one pre-packed session, whatever --prefill-weights says."""
    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    _, src = tied
    q = quantize(src, tmp_path / "q4", bits=4, group_size=32)
    split = quantize(src, tmp_path / "q4p", bits=4, group_size=32, format="portable")
    # (export, --prefill-weights as SessionConfig.prepack_prefill, whether prefill layers pre-pack)
    for directory, choice, packed in ((src, None, False), (split, None, True), (split, False, False),
                                      (src, True, True), (q, None, True), (q, False, True)):
        config = SessionConfig(threads=1, prepack_prefill=choice, stack=False)
        engine = Generator.open(directory, config=config).engine
        # the layers' bound graphs (decode: embed, layers, head; prefill: embed, layers) share sessions iff paired
        shared = [d.session is p.session for d, p in zip(engine.decode.graphs[1:-1], engine.prefill.graphs[1:],
                                                         strict=True)]
        assert set(shared) == {directory == q}, directory.name
        for name, place in engine.placement.items():
            if name.startswith("layer_") and name.endswith(".prefill"):
                assert place.prepack == packed and (place.release == ()) == packed, (directory.name, name)


def test_stack_graph_runs_what_the_layer_graphs_run(tied, tmp_path) -> None:
    """The stack graph of an fp32 or fast export (embedding + every layer in one session: 2 runs per decoded
    token, not N + 2) gives the runtime the logits its layer graphs give, through prefill chunks and decode
    steps. The portable format keeps its layer graphs only (standard ops, one graph per layer)."""
    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    _, src = tied
    q = quantize(src, tmp_path / "q4", bits=4, group_size=32)
    portable = quantize(src, tmp_path / "q4p", bits=4, group_size=32, format="portable")
    assert read_manifest(src).has_stack and not read_manifest(portable).has_stack
    for directory in (src, q):
        stacked = Generator.open(directory, config=SessionConfig(threads=1, exact=True)).engine
        layered = Generator.open(directory, config=SessionConfig(threads=1, stack=False)).engine
        assert [g.where for g in stacked.decode.graphs] == ["stack.decode", "head.decode"]
        assert [g.where for g in stacked.prefill.graphs] == ["stack.prefill"]
        assert stacked.prefill.graphs[0].session is stacked.decode.graphs[0].session       # one packed copy
        assert stacked.placement["stack.decode"].prepack and "layer_0.decode" not in stacked.placement
        assert len(layered.decode.graphs) == read_manifest(directory).n_layers + 2
        assert "stack.decode" not in layered.placement and layered.placement["layer_0.decode"].prepack
        prompt = [(7 * i + 3) % 200 + 4 for i in range(2 * read_manifest(directory).prefill_chunk + 3)]
        rows = {}
        for name, engine in (("stack", stacked), ("layers", layered)):
            got = [engine.forward(prompt).copy()]
            for _ in range(6):
                got.append(engine.forward([int(got[-1].argmax())]).copy())
            rows[name] = np.stack(got)
        scale = max(1.0, float(np.abs(rows["layers"]).max()))
        assert np.abs(rows["stack"] - rows["layers"]).max() <= 1e-5 * scale, directory.name
        assert rows["stack"].argmax(-1).tolist() == rows["layers"].argmax(-1).tolist()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_lookup_tables_are_released_between_steps(tied, tmp_path) -> None:
    """The embedding table is read only by Gather: the runtime hands it to the pre-packed stack from its own
    map and drops its pages at most every `table_interval_s` (the kernel maps a large folio around each row
    read, so a mapped table otherwise grows the RSS with every new token)."""
    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    _, src = tied
    # an fp32 lm_head: the lookup gets an int8 row table of its own (a quantized head shares its table)
    q = quantize(src, tmp_path / "q4", bits=4, group_size=32, lm_head="fp32")
    engine = Generator.open(q, config=SessionConfig(threads=1, exact=True)).engine
    assert engine.placement["stack.decode"].tables == ("embed.data",) and engine.tables == ("embed.data",)
    engine.forward(list(range(1, 12)))  # two prefill chunks

    def resident(interval_s: float, steps: int) -> list[int]:
        engine.table_interval_s = interval_s
        out = []
        for token in range(steps):
            engine.forward([token + 1])
            out.append(mapped_kb("embed.data"))
        return out

    assert all(kb > 0 for kb in resident(3600.0, 4))  # the stack reads the table from the runtime's map
    assert resident(0.0, 4) == [0] * 4               # and the runtime releases it
    assert all(kb > 0 for kb in resident(3600.0, 4))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_lookup_table_is_mapped_a_page_per_row_read(tmp_path) -> None:
    """A row read maps the table's page, not the page-cache folio around it: the file is read through first, as
    the sha256 check does (readahead fills the page cache with large folios, which Linux 6.18 maps whole on a
    fault); a prefill of rows all over the table then made most of it resident (weightmap._small_pages)."""
    from edgellm.export import ExportOptions, export_model
    from tests.export_helpers import tiny_model

    src = tmp_path / "fp32"  # a vocabulary of 8192: a table of 8192 int8 rows of 64 = 128 pages
    export_model(tiny_model("from-scratch", seed=3, vocab_size=8192), src, ExportOptions(granularity="layer", **OPTIONS),
                 progress=False, log=lambda _: None)
    q = quantize(src, tmp_path / "q4", bits=4, group_size=32, lm_head="fp32")
    _rows_map_pages(q, "embed.data")
    # a tied int4 head: the embedding gathers the head's codes and (float32) scales from head.data, which the
    # head's session also loads itself (onnxruntime's own read puts the file back in large folios)
    _rows_map_pages(quantize(src, tmp_path / "tied4", bits=4, group_size=32), "head.data")


def _rows_map_pages(export: Path, table: str) -> None:
    """Read `table` through (large folios where the kernel makes them), open the export, decode 3 tokens whose
    rows lie at the start, middle and end of the table: a few pages per row may be mapped, no more."""
    import os

    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    size_kb = (export / table).stat().st_size // 1024
    assert size_kb >= 64, "the table must span many pages for this test to mean anything"
    with open(export / table, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while f.read(1 << 20):
            pass
    engine = Generator.open(export, config=SessionConfig(threads=1)).engine
    assert table in engine.tables
    engine.table_interval_s = 3600.0  # no release between the steps
    vocab = engine.manifest.vocab_size
    tokens = [1, vocab // 2, vocab - 1]  # the first, middle and last pages of the table
    for t in tokens:
        engine.forward([t])
    # per row: its codes' page and its scales' page, in each part of a split table (two pages where a row straddles)
    assert 0 < mapped_kb(table) <= 4 * len(tokens) * 2 * 2, (mapped_kb(table), size_kb)


def test_info_describes_an_export(tied, tmp_path, capsys) -> None:
    """`edgellm info` on an export: its layout, precision and the graphs `edgellm run` executes per token."""
    _, src = tied
    q = quantize(src, tmp_path / "q4", bits=4, group_size=32)
    assert main(["info", str(src)]) == 0
    fp32 = capsys.readouterr().out
    assert main(["info", str(q)]) == 0
    int4 = capsys.readouterr().out
    assert f"format: edgellm-export {FORMAT_VERSION}" in fp32 and "precision: fp32" in fp32
    assert "per decoded token: stack.decode + head.decode (2 runs" in fp32
    assert "max relative |onnx - torch|" in fp32
    assert ("precision: int4 g32 sym rtn, format fast (accuracy level 4, scales float32 for 4-bit weights, float16 "
            "for 8-bit), lm_head int4, embeddings int8") in int4
    assert "per decoded token: stack.decode + head.decode (2 runs" in int4
    sizes = [line for line in int4.splitlines() if line.startswith("size: ")]
    assert len(sizes) == 1 and float(sizes[0].split()[1]) > 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_float32_scales_leave_the_rss_once_packed(tied, tmp_path) -> None:
    """`--scales-dtype auto` stores int4 weights' scales float32, as MatMulNBits reads them (int8's stay float16
    behind a Cast); the runtime hands them to the pre-packed sessions from its own maps and drops their pages
    once packed (onnxruntime keeps the initializer for the session's life: its own map, or the float32 copy it
    folds a Cast into). The same fp16-rounded values either way: the same logits, bit for bit."""
    import onnx

    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    _, src = tied
    auto = quantize(src, tmp_path / "auto", bits=4, group_size=32, int8_layers=(0,))
    half = quantize(src, tmp_path / "half", bits=4, group_size=32, int8_layers=(0,), scales_dtype="float16")
    stack = onnx.load(str(auto / "stack.onnx"), load_external_data=False)
    dtypes = {t.name: t.data_type for t in stack.graph.initializer}
    scales = {n.attribute[[a.name for a in n.attribute].index("bits")].i: dtypes.get(n.input[2])
              for n in stack.graph.node if n.op_type == "MatMulNBits"}
    assert scales == {4: onnx.TensorProto.FLOAT, 8: None}  # int8's: a Cast's output
    engines = [Generator.open(d, config=SessionConfig(threads=1, exact=True)).engine for d in (auto, half)]
    place = engines[0].placement["stack.decode"]
    assert place.prepack and place.packed_files and engines[1].placement["stack.decode"].packed_files == ()
    files = [Path(f).name for f in place.packed_files]
    assert all(mapped_kb(f) == 0 for f in files)  # released once packed
    prompt = list(range(1, 12))
    assert np.array_equal(engines[0].forward(prompt), engines[1].forward(prompt))
    for t in (5, 9, 200):
        assert np.array_equal(engines[0].forward([t]), engines[1].forward([t]))
    assert np.array_equal(engines[0].few_rows([7, 8, 9]), engines[1].few_rows([7, 8, 9]))
    assert all(mapped_kb(f) == 0 for f in files), files  # the kernels never read them again
