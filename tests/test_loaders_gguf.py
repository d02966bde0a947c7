"""GGUF files (llama.cpp): seeded transformers models written as llama.cpp's converter writes them must give
transformers' own GGUF load's logits through edgellm, for every family, float and quantized tensor type; the
RoPE-scaling forms GGUF carries match transformers' HF models; K-quants match transformers' own unpacking."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgellm.loaders import load_checkpoint
from edgellm.loaders.gguf_file import GGUFFile, GGUFSource
from edgellm.loaders.gguf_maps import unpermute
from edgellm.runtime.errors import EdgeError
from tests.gguf_helpers import Q, bpe_vocab, hf_model, permute, reference, spm_vocab, write_gguf

TOKENS = torch.randint(0, 290, (1, 12), generator=torch.Generator().manual_seed(1))


def logits_diff(path, positions=None):
    """Max |logits difference| between transformers' GGUF load and edgellm's, and edgellm's load."""
    ref, _ = reference(path)
    loaded = load_checkpoint(path)
    pos = None if positions is None else torch.tensor([positions])
    with torch.no_grad():
        want = ref(TOKENS, position_ids=pos).logits
        got, _ = loaded.model(TOKENS, positions=pos)
    return (want - got).abs().max().item() / max(1.0, want.abs().max().item()), loaded


@pytest.mark.parametrize("family,vocab,tied", [("llama", "spm", False), ("qwen2", "bpe", True),
                                               ("qwen3", "bpe", False)])
def test_family_logits_match_transformers(tmp_path, family, vocab, tied):
    v = spm_vocab() if vocab == "spm" else bpe_vocab()
    model = hf_model(family, len(v["tokens"]), tie_word_embeddings=tied)
    path = write_gguf(tmp_path / f"{family}.gguf", model, family, v)
    diff, loaded = logits_diff(path)
    assert diff <= 1e-5, diff
    with torch.no_grad():  # and the original model: the Q/K permutation was undone, nothing else changed
        assert (model(TOKENS).logits - loaded.model(TOKENS)[0]).abs().max().item() <= 1e-4
    cfg = loaded.config
    assert (cfg.preset, cfg.rope_style, cfg.tie_embeddings) == ({"llama": "llama2"}.get(family, family), "half", tied)
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.vocab_size) == (3, 1, 128 if family == "qwen3" else 32,
                                                                      len(v["tokens"]))
    assert (cfg.bos_id, cfg.eos_id, loaded.source) == (1, 2, "gguf")


LEGACY = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _mixed(model, family, types):
    """Each 2-D tensor gets the next type of `types`, so one file covers them all."""
    from tests.gguf_helpers import gguf_name
    names = [gguf_name(n) for n, t in model.state_dict().items() if t.dim() == 2]
    return {name: types[i % len(types)] for i, name in enumerate(names)}


@pytest.mark.parametrize("types", [LEGACY, K_TYPES], ids=["legacy-quants", "k-quants"])
def test_quantized_types_match_transformers(tmp_path, types):
    big = types is K_TYPES  # K-quant rows are multiples of 256 (random blocks: gguf-py cannot quantize them)
    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2) if big else {}
    v = bpe_vocab()
    model = hf_model("llama", len(v["tokens"]), seed=3, **sizes)
    path = write_gguf(tmp_path / "q.gguf", model, "llama", v, tensor_types=_mixed(model, "llama", types))
    with GGUFFile(path) as g:
        assert set(g.type_histogram()) == {t.name for t in types} | {"F32"}
    diff, _ = logits_diff(path)
    assert diff <= 1e-5, diff


def test_k_quants_match_transformers_kernels(tmp_path):
    """gguf-py's K-quant unpacking (what edgellm uses) == transformers' own implementation, bit for bit."""
    kernels = pytest.importorskip("transformers.integrations.gguf.kernels")
    v = bpe_vocab()
    model = hf_model("qwen2", len(v["tokens"]), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2)
    path = write_gguf(tmp_path / "k.gguf", model, "qwen2", v, tensor_types=_mixed(model, "qwen2", K_TYPES))
    with GGUFFile(path) as g:
        source = GGUFSource(g)
        for name, tensor in g.tensors.items():
            if tensor.tensor_type.name.endswith("_K"):
                rows, cols = g.numpy_shape(name)
                want = kernels.dequantize_blocks(torch.from_numpy(np.array(tensor.data)), int(tensor.tensor_type),
                                                 rows, cols, torch.float32)
                assert torch.equal(source.get(name), want), name


def test_unpermute_inverts_llamacpp_permutation():
    w = np.arange(6 * 32 * 5, dtype=np.float32).reshape(6 * 32, 5)
    for heads in (1, 2, 6):
        assert np.array_equal(unpermute(heads)(permute(w, heads)), w)
        assert not np.array_equal(permute(w, heads), w)


def test_mistral_named_llama_file_gets_the_mistral_preset(tmp_path):
    v = bpe_vocab()
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(v["tokens"])), "llama", v,
                      name="Mistral 7B Instruct v0.3", meta={"{arch}.rope.freq_base": 1e6})
    cfg = load_checkpoint(path).config
    assert cfg.preset == "mistral" and cfg.rope_theta == 1e6


def test_end_of_turn_ids_end_generation(tmp_path):
    v = bpe_vocab()
    path = write_gguf(tmp_path / "e.gguf", hf_model("qwen2", len(v["tokens"])), "qwen2", v,
                      meta={"tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.eom_token_id": 2})
    cfg = load_checkpoint(path).config
    assert (cfg.eos_id, cfg.end_ids) == (2, (0,))  # eom == eos is not repeated


def test_dispatch_by_magic_not_name(tmp_path):
    """A GGUF named .bin is still read as GGUF (not as llama2.c); a .gguf without the magic is refused."""
    v = bpe_vocab()
    path = write_gguf(tmp_path / "x.gguf", hf_model("qwen2", len(v["tokens"])), "qwen2", v)
    renamed = path.rename(tmp_path / "model.bin")
    assert load_checkpoint(renamed).source == "gguf"
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"\x00" * 64)
    with pytest.raises(EdgeError, match="not a GGUF file"):
        load_checkpoint(fake)


def _llama3_factors(theta: float, hd: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: the rope_freqs tensor for Llama 3.1 scaling."""
    out = []
    for i in range(hd // 2):
        wavelen = 2 * math.pi / theta ** (-2 * i / hd)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_matches_transformers(tmp_path, kind):
    """GGUF carries Llama 3.1 scaling as a rope_freqs tensor and linear scaling as metadata; transformers'
    GGUF reader ignores both, so the reference is the HF model with the same rope_parameters."""
    import gguf

    v = bpe_vocab()
    params = ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32} if kind == "llama3"
              else {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    model = hf_model("llama", len(v["tokens"]), rope_parameters=params)
    meta = {} if kind == "llama3" else {"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0}
    path = write_gguf(tmp_path / "r.gguf", model, "llama", v, meta=meta)
    if kind == "llama3":  # append the tensor llama.cpp writes
        reader = gguf.GGUFReader(path)
        w = gguf.GGUFWriter(str(tmp_path / "r3.gguf"), "llama")
        for key, field in reader.fields.items():
            if not key.startswith(("GGUF.", "general.architecture")):
                w.add_key_value(key, field.contents(), field.types[0],
                                sub_type=field.types[-1] if len(field.types) > 1 else None)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.add_tensor("rope_freqs.weight", _llama3_factors(10000.0, 32, 8.0, 1.0, 4.0, 32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        path = tmp_path / "r3.gguf"
    loaded = load_checkpoint(path)
    pos = torch.tensor([list(range(100, 112))])
    with torch.no_grad():
        want = model(TOKENS, position_ids=pos).logits
        got, _ = loaded.model(TOKENS, positions=pos)
        unscaled = load_checkpoint(write_gguf(tmp_path / "plain.gguf", model, "llama", v)).model(TOKENS, positions=pos)[0]
    assert (want - got).abs().max().item() <= 1e-4
    assert (want - unscaled).abs().max().item() > 1e-3  # the scaling matters at these positions


def test_yarn_scaling_is_refused(tmp_path):
    v = bpe_vocab()
    path = write_gguf(tmp_path / "y.gguf", hf_model("qwen2", len(v["tokens"])), "qwen2", v,
                      meta={"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0})
    with pytest.raises(EdgeError, match="rope scaling type 'yarn' is not supported"):
        load_checkpoint(path)


def test_reader_reads_what_gguf_py_reads(tmp_path):
    """edgellm's one-pass reader (gguf_read.py) against gguf-py's GGUFReader on a file holding every metadata
    value type (strings, arrays of strings, of numbers and of arrays) and float and quantized tensors."""
    import gguf

    from edgellm.loaders.gguf_read import read_gguf

    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", 290), "llama", spm_vocab(), qtype=Q.Q4_K,
                      meta={"test.u8": (7, gguf.GGUFValueType.UINT8), "test.i16": (-3, gguf.GGUFValueType.INT16),
                            "test.u64": (2**40, gguf.GGUFValueType.UINT64), "test.f64": (0.1, gguf.GGUFValueType.FLOAT64),
                            "test.bool": (True, gguf.GGUFValueType.BOOL), "test.nested": [[1, 2], [3]],
                            "test.floats": [0.5, -1.25], "test.words": ["a", "ß", "🙂", ""]})
    fields, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert theirs.pop("test.nested") == [1, 2, 3]  # gguf-py flattens an array of arrays; the file holds two
    assert theirs == {k: v for k, v in fields.items() if k != "test.nested"}
    assert fields["test.words"] == ["a", "ß", "🙂", ""] and fields["test.nested"] == [[1, 2], [3]]
    assert [t.name for t in reader.tensors] == list(tensors) and any(t.tensor_type == Q.Q4_K for t in reader.tensors)
    for t in reader.tensors:
        ours = tensors[t.name]
        assert (ours.tensor_type, ours.data_offset, ours.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert ours.shape == tuple(int(n) for n in t.shape)
        assert np.array_equal(ours.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
