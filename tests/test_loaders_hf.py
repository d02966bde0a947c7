"""Hugging Face checkpoints: seeded transformers models saved with save_pretrained (single and sharded) must give
the same logits through edgellm; a hand-written MiniCPM checkpoint is checked against a numpy forward of seed
002's formulas; broken or unsupported checkpoints raise EdgeError."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgellm.loaders import load_checkpoint
from edgellm.runtime.errors import EdgeError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_theta": 1e6}),
}


def save_hf(family: str, out: Path, seed: int = 0, shard: str | None = None, **over) -> torch.nn.Module:
    """A seeded transformers model, norms and biases randomised too (they are 1 and 0 at init), saved to out."""
    config_cls, model_cls, extra = FAMILIES[family]
    fields = {**SMALL, **extra, **over}
    theta = fields.pop("rope_theta", None)
    if theta is not None and "rope_scaling" in fields:
        fields["rope_theta"] = theta  # transformers 4 keywords: transformers 5 folds both into rope_parameters
    elif theta is not None and "rope_parameters" not in fields:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return model


def compare(hf_model: torch.nn.Module, path: Path, positions: list[int] | None = None):
    """Max |logits difference| between transformers and edgellm on 12 seeded tokens, and the loaded checkpoint."""
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = None if positions is None else torch.tensor([positions])
    with torch.no_grad():
        want = hf_model(tokens, position_ids=pos).logits
        got, _ = loaded.model(tokens, positions=pos)
    return (want - got).abs().max().item(), loaded


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_transformers(tmp_path, family):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = save_hf(family, tmp_path)
        diff, loaded = compare(model, tmp_path)
    assert diff <= 1e-4, diff
    cfg = loaded.config
    assert cfg.preset == {"llama": "llama2"}.get(family, family) and cfg.rope_style == "half"
    assert cfg.tie_embeddings == (family == "qwen2") and cfg.qkv_bias == (family == "qwen2")
    assert cfg.qk_norm == (family == "qwen3") and cfg.hd == (32 if family == "qwen3" else 16)
    assert cfg.rope_theta == (1e6 if family in ("mistral", "qwen3") else 10000.0)
    if family == "mistral":  # sliding_window 4096 < 131072 positions: loaded exactly up to the window
        assert cfg.max_seq_len == 4096
        assert any("sliding_window" in str(w.message) for w in caught)


def test_sharded_checkpoint(tmp_path):
    model = save_hf("qwen2", tmp_path, seed=2, shard="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert compare(model, tmp_path)[0] <= 1e-4

    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(EdgeError, match=shard.name):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_static_rope_scalings(tmp_path, rope):
    model = save_hf("llama", tmp_path, seed=3, rope_parameters=rope, max_position_embeddings=4096)
    # far-apart positions, so that the scaled low frequencies change the logits
    diff, loaded = compare(model, tmp_path, positions=[0, 5, 40, 90, 200, 333, 700, 1000, 1500, 2200, 3000, 4000])
    assert diff <= 1e-4, diff
    assert loaded.config.rope_long_factor == loaded.config.rope_short_factor and max(loaded.config.rope_long_factor) > 1


FAR = [0, 5, 40, 90, 200, 333, 700, 1000, 1500, 2200, 3000, 4000]  # positions past every scaled region
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family,rope_scaling,theta", [
    ("llama", LLAMA3, 500000.0),                           # Llama 3.1/3.2 as their config.json says it
    ("llama", {"type": "linear", "factor": 4.0}, None),    # the oldest key for the rope type
    ("qwen2", {"rope_type": "linear", "factor": 2.0}, 1e6),
    ("qwen3", LLAMA3, 1e6),
])
def test_rope_scaling_as_transformers5_writes_it(tmp_path, family, rope_scaling, theta):
    """A config made with transformers 4 keywords (rope_theta, rope_scaling) is saved by transformers 5 as
    `rope_parameters` only; edgellm reads that, and the same config rewritten the transformers 4 way
    (top-level rope_theta + rope_scaling, as older hub checkpoints ship it), to transformers' logits at
    positions far past original_max_position_embeddings (64) and the factor's range."""
    over = {"rope_scaling": dict(rope_scaling), "max_position_embeddings": 4096}  # transformers 5 edits it
    model = save_hf(family, tmp_path, seed=5, **over, **({"rope_theta": theta} if theta is not None else {}))
    config = json.loads((tmp_path / "config.json").read_text())
    params = config["rope_parameters"]
    assert "rope_theta" not in config and not config.get("rope_scaling")  # transformers 5's layout
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    assert params["rope_type"] == kind and params["rope_theta"] == (theta or 10000.0)
    diff, loaded = compare(model, tmp_path, positions=FAR)
    assert diff <= 1e-4, diff
    assert loaded.config.rope_theta == (theta or 10000.0) and max(loaded.config.rope_long_factor) > 1

    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    legacy.update(rope_theta=params["rope_theta"], rope_scaling={k: v for k, v in params.items() if k != "rope_theta"})
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    diff, again = compare(model, tmp_path, positions=FAR)
    assert diff <= 1e-4, diff
    assert again.config.to_dict() == loaded.config.to_dict()


def test_legacy_rope_theta_key(tmp_path):
    """transformers 4 configs carry rope_theta (+ rope_scaling) at the top level instead of rope_parameters."""
    model = save_hf("llama", tmp_path, seed=4, rope_theta=50000.0)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=50000.0, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    diff, loaded = compare(model, tmp_path)
    assert diff <= 1e-4 and loaded.config.rope_theta == 50000.0
    assert loaded.tokenizer_path == tmp_path / "tokenizer.json"


def test_broken_and_unsupported_checkpoints(tmp_path):
    save_hf("llama", tmp_path)
    config_path, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    config = json.loads(config_path.read_text())

    def load_with(**changes):
        config_path.write_text(json.dumps({**config, **changes}))
        return load_checkpoint(tmp_path)

    with pytest.raises(EdgeError, match="rope type 'yarn' is not supported"):
        load_with(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(EdgeError, match="model_type 'bert' is not supported"):
        load_with(model_type="bert")
    with pytest.raises(EdgeError, match="attention_bias"):
        load_with(attention_bias=True)
    with pytest.raises(EdgeError, match="quantized"):
        load_with(quantization_config={"quant_method": "gptq"})
    with pytest.raises(EdgeError, match="give 128 rows for layers.0.attn.qkv.weight; expected 192"):
        load_with(num_key_value_heads=4)  # k_proj/v_proj hold 2 kv heads, the config claims 4
    with pytest.raises(EdgeError, match="embed_tokens.weight has 256 rows for embed.weight; expected 300"):
        load_with(vocab_size=300)
    config_path.write_text(json.dumps(config))

    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(EdgeError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path)
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, weights)
    with pytest.raises(EdgeError, match="unexpected tensors model.layers.0.self_attn.o_proj.bias"):
        load_checkpoint(tmp_path)

    blob = weights.read_bytes()
    weights.write_bytes(blob[:8] + b"\x00" * 8 + blob[16:])  # clobber the JSON header
    with pytest.raises(EdgeError, match="model.safetensors"):
        load_checkpoint(tmp_path)
    weights.write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(EdgeError, match="model.safetensors"):
        load_checkpoint(tmp_path)
    weights.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(EdgeError, match="pickle"):
        load_checkpoint(tmp_path)


# ---- MiniCPM: no transformers class, so the checkpoint is written here and checked against seed 002 ----

MINICPM = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
               scale_emb=12.0, scale_depth=1.4, dim_model_base=16)


def minicpm_checkpoint(out: Path, qk_norm: bool) -> tuple[dict, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    d, f, hd, h, kv = 64, 96, 16, 4, 2
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": list(1.0 + 0.1 * rng.random(hd // 2)), "long_factor": list(1.0 + 4.0 * rng.random(hd // 2))}
    config = {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm", "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": [2, 73440], "rope_scaling": rope, **MINICPM,
              **({"qk_norm": True} if qk_norm else {})}
    shapes = {"model.embed_tokens.weight": (256, d), "model.norm.weight": (d,)}  # no lm_head: tied
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                       p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
        if qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    weights = {name: (rng.standard_normal(s) * (0.2 if len(s) == 1 else 0.1) + (1.0 if len(s) == 1 else 0.0))
               .astype(np.float32) for name, s in shapes.items()}
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, str(out / "model.safetensors"))
    return config, weights


def minicpm_numpy(c: dict, w: dict[str, np.ndarray], tokens: list[int], qk_norm: bool) -> np.ndarray:
    """Seed 002: embeddings * scale_emb; residual branches * scale_depth / sqrt(L); LongRoPE with the factor set
    chosen by the cache length (max_position_embeddings) vs original, cos/sin * sqrt(1 + ln s / ln original);
    rotate-half; hidden / (hidden_size / dim_model_base) before the (tied) lm_head."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h, kv, hd, n_layers = 4, 2, 16, c["num_hidden_layers"]
    rope = c["rope_scaling"]
    norm = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + c["rms_norm_eps"]) * g  # noqa: E731
    original = rope["original_max_position_embeddings"]
    ext = np.array(rope["long_factor"] if c["max_position_embeddings"] > original else rope["short_factor"])
    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(len(tokens)), 1.0 / ext) * inv_freq
    emb = np.concatenate([freqs, freqs], -1)
    scaling = math.sqrt(1 + math.log(c["max_position_embeddings"] / original) / math.log(original))
    cos, sin = np.cos(emb) * scaling, np.sin(emb) * scaling  # [S, hd]

    def rotary(x):  # x [heads, S, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    s = len(tokens)
    x = w["model.embed_tokens.weight"][tokens] * c["scale_emb"]
    branch = c["scale_depth"] / math.sqrt(n_layers)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = norm(x, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(s, h, hd).transpose(1, 0, 2)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(s, kv, hd).transpose(1, 0, 2)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(s, kv, hd).transpose(1, 0, 2)
        if qk_norm:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rotary(q), rotary(k)
        k, v = np.repeat(k, h // kv, axis=0), np.repeat(v, h // kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + np.triu(np.full((s, s), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out = (probs / probs.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(s, h * hd)
        x = x + (out @ w[p + "self_attn.o_proj.weight"].T) * branch
        m = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T) * branch
    x = norm(x, w["model.norm.weight"]) / (c["hidden_size"] / c["dim_model_base"])
    return x @ w["model.embed_tokens.weight"].T


@pytest.mark.parametrize("qk_norm", [False, True])
def test_minicpm_matches_seed_formulas(tmp_path, qk_norm):
    config, weights = minicpm_checkpoint(tmp_path, qk_norm)
    loaded = load_checkpoint(tmp_path)
    cfg = loaded.config
    assert cfg.preset == "minicpm4" and cfg.tie_embeddings and cfg.qk_norm == qk_norm
    assert (cfg.scale_emb, cfg.scale_depth, cfg.dim_model_base, cfg.rope_original_max) == (12.0, 1.4, 16, 32)
    assert (cfg.bos_id, cfg.eos_id) == (1, 2)
    tokens = [1, 7, 200, 33, 33, 91, 5, 250, 14, 2]
    with torch.no_grad():
        got = loaded.model(torch.tensor([tokens]))[0][0].double().numpy()
    want = minicpm_numpy(config, weights, tokens, qk_norm)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
