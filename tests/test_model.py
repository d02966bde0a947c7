"""The decoder against an independent numpy forward of the seed formulas, and its cache paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edgellm.model import PRESETS, Decoder, ModelConfig
from edgellm.model.rope import Rotary, rotate
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.graphio import cache_rows
from edgellm.runtime.kvcache import KVCache
from tests import reference_numpy as ref


def tiny(preset: str, **over) -> Decoder:
    """A seeded tiny model whose 1-D weights (norms, LayerScale, biases) are random too, so tests can fail."""
    sizes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=300, max_seq_len=64)
    if preset == "qwen3":
        sizes["head_dim"] = 32
    cfg = ModelConfig.preset_config(preset, **{**sizes, **over})
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
    return model


def state(model: Decoder) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in model.state_dict().items()}


# gemma3 (post-norms, GeGLU, sliding layers) is checked against transformers' Gemma3ForCausalLM (test_gemma3.py)
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "gemma3"])
def test_forward_matches_independent_reference(preset):
    model = tiny(preset)
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(tokens)
    expected = ref.forward(state(model), model.cfg.to_dict(), tokens[0].tolist())
    np.testing.assert_allclose(logits[0].double().numpy(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("over", [dict(pos_embedding="sinusoidal"), dict(mlp_kind="gelu", n_kv_heads=4),
                                  dict(pos_embedding="sinusoidal", mlp_kind="swiglu", norm_kind="rms")])
def test_nanogpt_variants_match_independent_reference(over):
    """Seed 004's sinusoidal table (written pair by pair from its formula in the reference), exact GELU, and a
    sinusoidal model with the Llama block: each switch on its own."""
    model = tiny("nanogpt", **over)
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(tokens)
    expected = ref.forward(state(model), model.cfg.to_dict(), tokens[0].tolist())
    np.testing.assert_allclose(logits[0].double().numpy(), expected, atol=1e-4, rtol=0)
    assert model.rotary is None and "pos_table" not in model.state_dict()


def test_sinusoidal_table_definition():
    from edgellm.model.rope import sinusoidal_table
    table = sinusoidal_table(50, 16).double().numpy()
    np.testing.assert_allclose(table, np.stack([ref.sinusoid(p, 16) for p in range(50)]), atol=1e-6)
    assert table[0, 0::2].max() == 0 and table[0, 1::2].min() == 1  # position 0: sin 0, cos 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_prefill_then_decode_through_cache_equals_full_forward(preset):
    # gemma3: a window of 6, so its sliding layer keeps a ring of 6 rows that chunks of 9 and 7 overrun
    model = tiny(preset, **({"sliding_window": 6} if preset == "gemma3" else {}))
    cfg = model.cfg
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(2))
    rows = cache_rows(cfg.to_dict(), cfg.max_seq_len)
    assert (preset == "gemma3") == (rows == (6, 64))
    cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.max_seq_len, cfg.hd, rows=rows)
    pieces = [tokens[:, :9], tokens[:, 9:16]] + [tokens[:, i:i + 1] for i in range(16, 30)]
    outs = []
    with torch.no_grad():
        full, _ = model(tokens)
        for piece in pieces:
            past = [(torch.from_numpy(cache.keys[i]), torch.from_numpy(cache.values[i])) for i in range(cfg.n_layers)]
            logits, new = model(piece, past=past, past_len=torch.from_numpy(cache.past_len()))
            for i, (k, v) in enumerate(new):
                cache.write(i, k.numpy(), v.numpy(), piece.shape[1])
            cache.advance(piece.shape[1])
            outs.append(logits)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


def test_xpos_scale_values_and_shift_invariance():
    cfg = ModelConfig.preset_config("stellarbyte", dim=64, n_heads=4, max_seq_len=128)
    rotary = Rotary(cfg)
    positions = torch.tensor([[0, 5, 64, 100]])
    _, _, q_scale, k_scale = rotary(positions)
    hd, center = cfg.hd, 64
    for j, pos in enumerate([0, 5, 64, 100]):
        expected = [((2 * i / hd + 0.4) / 1.4) ** ((pos - center) / 512.0) for i in range(hd // 2)]
        got = q_scale[0, 0, j].numpy()
        np.testing.assert_allclose(got[: hd // 2], expected, rtol=1e-6)  # rotate-half: both halves carry scale_i
        np.testing.assert_allclose(got[hd // 2:], expected, rtol=1e-6)
        np.testing.assert_allclose(k_scale[0, 0, j].numpy(), 1 / got, rtol=1e-6)
    assert q_scale[0, 0, 2].allclose(torch.ones(hd))  # the fixed centre has scale 1

    # q.k after XPos depends on positions only through their difference (so cached keys stay valid)
    from edgellm.model.rope import apply_rotary
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(pq: int, pk: int) -> float:
        cq, sq, qs, _ = rotary(torch.tensor([[pq]]))
        ck, sk, _, ks = rotary(torch.tensor([[pk]]))
        return float((apply_rotary(q, cq, sq, qs, "half") * apply_rotary(k, ck, sk, ks, "half")).sum())

    assert score(30, 10) == pytest.approx(score(90, 70), rel=1e-4)
    assert score(30, 10) != pytest.approx(score(30, 20), rel=1e-3)


def test_longrope_switches_factors_on_context_and_scales_cos_sin():
    cfg = ModelConfig.preset_config("minicpm4", dim=64, n_heads=4, n_kv_heads=2, max_seq_len=1024,
                                    rope_original_max=256)
    hd = cfg.hd
    base = [10000 ** (-2 * i / hd) for i in range(hd // 2)]
    mscale = math.sqrt(1 + math.log(1024 / 256) / math.log(256))
    pos = 37
    for context, factors in ((256, cfg.rope_short_factor), (257, cfg.rope_long_factor), (1024, cfg.rope_long_factor)):
        cos, sin, _, _ = Rotary(cfg, context)(torch.tensor([[pos]]))
        expected = [math.cos(pos * b / f) * mscale for b, f in zip(base, factors, strict=True)]
        np.testing.assert_allclose(cos[0, 0, 0, : hd // 2].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert cfg.rope_long_factor != cfg.rope_short_factor
    # no extension (max_seq_len <= original) -> scaling factor 1
    flat = cfg.replace(max_seq_len=256)
    cos, sin, _, _ = Rotary(flat, 256)(torch.tensor([[0]]))
    assert cos[0, 0, 0].allclose(torch.ones(hd))


def test_minicpm_depth_width_and_embedding_scaling():
    model = tiny("minicpm4")
    cfg = model.cfg
    assert cfg.residual_scale == pytest.approx(1.4 / math.sqrt(2))
    assert cfg.width_scale == pytest.approx(64 / 64) or cfg.width_scale == pytest.approx(cfg.dim / 64)
    tokens = torch.tensor([[3, 4]])
    np.testing.assert_allclose(model.embed_tokens(tokens).detach().numpy(),
                               model.embed.weight[tokens].detach().numpy() * 12.0, rtol=1e-6)
    wide = tiny("minicpm4", dim=128, n_heads=4)
    h = torch.randn(1, 2, 128)
    normed = wide.norm(h) / (128 / 64)
    np.testing.assert_allclose(wide.head(h).detach().numpy(), (normed @ wide.embed.weight.T).detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_interleaved_rope_is_rotate_half_on_permuted_dims():
    hd = 8
    x = torch.randn(1, 1, 1, hd)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pair i = (2i, 2i+1) -> (i, i + hd/2)
    assert torch.equal(rotate(x, "interleaved")[..., perm], rotate(x[..., perm], "half"))
    assert not torch.equal(rotate(x, "interleaved"), rotate(x, "half"))


def test_norm_clamp_vs_add_differ_only_near_zero():
    from edgellm.model.layers import RMSNorm
    add, clamp = RMSNorm(4, 1e-2, "add"), RMSNorm(4, 1e-2, "clamp")
    small = torch.full((1, 4), 1e-3)
    assert torch.allclose(clamp(small), small / math.sqrt(1e-2))
    assert torch.allclose(add(small), small / math.sqrt(1e-6 + 1e-2))
    big = torch.randn(1, 4) * 10
    assert torch.allclose(add(big), clamp(big), rtol=1e-3)


def test_dropout_and_droppath_act_only_in_training():
    model = tiny("stellarbyte", drop_path=0.5, dropout=0.3)
    tokens = torch.randint(0, 300, (4, 10))
    with torch.no_grad():
        a, _ = model(tokens)
        b, _ = model(tokens)
        model.train()
        c, _ = model(tokens)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_config_rejects_bad_values_and_round_trips():
    cfg = ModelConfig.preset_config("minicpm4")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(EdgeError, match="unknown preset"):
        ModelConfig.preset_config("gpt5")
    with pytest.raises(EdgeError, match="unknown config keys: bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(EdgeError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=6, n_kv_heads=4)


def test_param_count_matches_module():
    for preset in PRESETS:
        model = tiny(preset)
        assert model.cfg.n_params() == sum(p.numel() for p in model.parameters()), preset
