"""GPT-2 checkpoints (seed 004's model, preset nanogpt): a seeded transformers GPT2LMHeadModel saved with
save_pretrained (odd sizes, norms and biases randomised) must give the same logits through edgellm, in both name
layouts (GPT2LMHeadModel's `transformer.` prefix and GPT2Model's bare names with the mask buffers the original
checkpoints carry); configs edgellm would compute differently are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgellm.loaders import load_checkpoint
from edgellm.runtime.errors import EdgeError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=203, n_positions=40, n_embd=48, n_layer=3, n_head=3, n_inner=88, bos_token_id=5,
             eos_token_id=7)


def save_gpt2(out: Path, seed: int = 0, **over) -> torch.nn.Module:
    """A seeded GPT2LMHeadModel with spread in every weight (LayerNorm gains/biases and linear biases too)."""
    config = transformers.GPT2Config(**{**SMALL, **over})
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    model.save_pretrained(out)
    return model


def max_diff(hf_model: torch.nn.Module, path: Path, n: int = 17) -> tuple[float, object]:
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(tokens).logits
        got, _ = loaded.model(tokens)
    return (want - got).abs().max().item(), loaded


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_gpt2_logits_match_transformers(tmp_path, act):
    model = save_gpt2(tmp_path, activation_function=act)
    diff, loaded = max_diff(model, tmp_path)
    assert diff <= 1e-4, diff
    cfg = loaded.config
    assert cfg.preset == "nanogpt" and cfg.pos_embedding == "learned" and not cfg.rotary
    assert cfg.norm_kind == "layer" and cfg.linear_bias and cfg.tie_embeddings and cfg.n_kv_heads == 3
    assert cfg.mlp_kind == ("gelu_tanh" if act == "gelu_new" else "gelu")
    assert (cfg.hidden_dim, cfg.max_seq_len, cfg.bos_id, cfg.eos_id) == (88, 40, 5, 7)


def test_gpt2model_names_and_mask_buffers(tmp_path):
    """The original checkpoints: no `transformer.` prefix, no lm_head, `attn.bias`/`attn.masked_bias` buffers."""
    model = save_gpt2(tmp_path, seed=3)
    path = tmp_path / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(path).items() if k != "lm_head.weight"}
    for i in range(SMALL["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 40, 40))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, path)
    diff, _ = max_diff(model, tmp_path)
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("key,value", [("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True),
                                       ("reorder_and_upcast_attn", True), ("activation_function", "relu"),
                                       ("add_cross_attention", True)])
def test_unsupported_gpt2_options_refused(tmp_path, key, value):
    save_gpt2(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(EdgeError, match=key):
        load_checkpoint(tmp_path)


def test_conv1d_shape_mismatch_named(tmp_path):
    """A c_fc stored [out, in] (not Conv1D's [in, out]) is a shape error naming the tensor, never a silent load."""
    save_gpt2(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"].t().contiguous()
    save_file(tensors, path)
    with pytest.raises(EdgeError, match="h.1.mlp.c_fc.weight"):
        load_checkpoint(tmp_path)


def write_gpt2_gguf(path: Path, model: torch.nn.Module, vocab: dict) -> Path:
    """The model as llama.cpp's converter writes GPT-2: Conv1D weights transposed to [out, in], `output.weight`
    a copy of the token table, LayerNorm epsilon under `gpt2.attention.layer_norm_epsilon`."""
    from tests.gguf_helpers import _add, gguf

    cfg, sd = model.config, {k.removeprefix("transformer."): v.float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "gpt2")
    meta = {"general.name": "gpt2 test", "gpt2.context_length": cfg.n_positions, "gpt2.embedding_length": cfg.n_embd,
            "gpt2.feed_forward_length": cfg.n_inner or 4 * cfg.n_embd, "gpt2.block_count": cfg.n_layer,
            "gpt2.attention.head_count": cfg.n_head, "gpt2.attention.layer_norm_epsilon": cfg.layer_norm_epsilon,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": vocab["tokens"],
            "tokenizer.ggml.token_type": vocab["types"], "tokenizer.ggml.merges": vocab["merges"],
            "tokenizer.ggml.bos_token_id": vocab["bos"], "tokenizer.ggml.eos_token_id": vocab["eos"]}
    for key, value in meta.items():
        _add(w, key, value)
    tensors = {"token_embd.weight": sd["wte.weight"], "position_embd.weight": sd["wpe.weight"],
               "output_norm.weight": sd["ln_f.weight"], "output_norm.bias": sd["ln_f.bias"],
               "output.weight": sd["wte.weight"]}
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(cfg.n_layer):
        for hf, ours in names.items():
            for kind in ("weight", "bias"):
                t = sd[f"h.{i}.{hf}.{kind}"]
                tensors[f"blk.{i}.{ours}.{kind}"] = t.T.copy() if t.ndim == 2 else t
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_gpt2_matches_transformers(tmp_path):
    """llama.cpp's `gpt2` architecture: edgellm's load == the HF model it was written from == transformers' own
    GGUF load of the file."""
    pytest.importorskip("gguf")
    from tests.gguf_helpers import bpe_vocab, reference

    vocab = bpe_vocab()
    # transformers' GGUF reader maps neither context_length nor feed_forward_length for gpt2: GPT-2's defaults
    model = save_gpt2(tmp_path / "hf", vocab_size=len(vocab["tokens"]), bos_token_id=vocab["bos"],
                      eos_token_id=vocab["eos"], n_positions=1024, n_inner=None)
    path = write_gpt2_gguf(tmp_path / "gpt2.gguf", model, vocab)
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, len(vocab["tokens"]), (1, 15), generator=torch.Generator().manual_seed(2))
    ref, _ = reference(path)
    with torch.no_grad():
        got, _ = loaded.model(tokens)
        for want in (model(tokens).logits, ref(tokens).logits):
            assert (want - got).abs().max().item() <= 1e-4
    cfg = loaded.config
    assert (cfg.preset, cfg.pos_embedding, cfg.norm_kind, cfg.mlp_kind, cfg.max_seq_len) == (
        "nanogpt", "learned", "layer", "gelu_tanh", 1024)
