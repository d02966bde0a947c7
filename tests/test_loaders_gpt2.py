"""GPT-2 checkpoints (seed 004's model, preset nanogpt): a seeded transformers GPT2LMHeadModel saved with
save_pretrained (odd sizes, norms and biases randomised) must give the same logits through edgellm, in both name
layouts (GPT2LMHeadModel's `transformer.` prefix and GPT2Model's bare names with the mask buffers the original
checkpoints carry); configs edgellm would compute differently are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

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
