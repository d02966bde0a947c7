"""edgellm/layout/pairing.py: a layer's (or the embedding's) prefill and decode graphs merged into one graph with S
symbolic must compute exactly what each variant graph computes, for every preset's S-constants (Reshape
targets, the S of XPos' `total_len - S`); variants that differ otherwise are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgellm.layout.pairing import pair_layer
from edgellm.model import PRESETS
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.manifest import read_manifest
from tests.quant_helpers import OPTIONS, export

CHUNK = OPTIONS["prefill_chunk"]


def feeds(session: ort.InferenceSession, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs for one variant: `past` rows 0..9 filled, the S new tokens after them."""
    past = 10
    out = {}
    for i in session.get_inputs():
        shape = [seq if isinstance(d, str) else d for d in i.shape]
        if i.name == "tokens":
            out[i.name] = rng.integers(0, 32, shape).astype(np.int64)
        elif i.name == "seqlens_k":
            out[i.name] = np.full(shape, past + seq - 1, np.int32)
        elif i.name == "total_len":
            out[i.name] = np.array(past + seq, np.int32)
        elif i.name == "positions":  # the embedding's, with an absolute position table (nanogpt)
            out[i.name] = (past + np.arange(seq, dtype=np.int64))[None, :]
        else:
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_merged_graph_computes_each_variant(preset: str, tmp_path: Path) -> None:
    _, src = export(tmp_path, preset, "layer")
    assert read_manifest(src).kv_layout == "inplace"
    rng = np.random.default_rng(0)
    for stem in ("embed", "layer_1"):
        variants = {seq: src / f"{stem}.{'decode' if seq == 1 else 'prefill'}.onnx" for seq in (CHUNK, 1)}
        merged = pair_layer(onnx.load(variants[CHUNK], load_external_data=False),
                            onnx.load(variants[1], load_external_data=False))
        assert all(n.op_type != "If" for n in merged.graph.node)
        assert "decode" not in {i.name for i in merged.graph.input}
        path = src / f"{stem}.merged.onnx"  # beside its data file
        onnx.save(merged, path)
        both = session(path)
        for seq, file in variants.items():
            feed = feeds(both, seq, rng)
            want = session(file).run(None, feed)
            got = both.run(None, feed)
            for w, g in zip(want, got, strict=True):
                assert g.shape == w.shape and np.array_equal(g, w), (preset, stem, seq)


def test_variants_that_differ_are_refused(tmp_path: Path) -> None:
    _, src = export(tmp_path, "qwen3", "layer")
    prefill = onnx.load(src / "layer_0.prefill.onnx", load_external_data=False)
    decode = onnx.load(src / "layer_0.decode.onnx", load_external_data=False)
    other = onnx.ModelProto()
    other.CopyFrom(decode)
    other.graph.node[-1].op_type = "Sub"
    with pytest.raises(EdgeError, match="run different nodes, they cannot be merged"):
        pair_layer(prefill, other)
    other.CopyFrom(decode)
    shape = next(t for t in other.graph.initializer if t.name.endswith("q.heads"))
    heads = onnx.numpy_helper.to_array(shape).copy()
    heads[2] += 1  # a head count, not S: no S-free form computes both variants
    shape.CopyFrom(onnx.numpy_helper.from_array(heads, shape.name))
    with pytest.raises(EdgeError, match=r"cannot merge the variants' constant '.*q\.heads'"):
        pair_layer(prefill, other)
