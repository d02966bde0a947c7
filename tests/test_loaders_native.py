"""edgellm's native checkpoint: bitwise round trip (model and optimizer state), atomic replacement, and every way
a reader must refuse a directory; plus load_checkpoint's dispatch errors and `edgellm info`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgellm.cli import main
from edgellm.loaders import load_checkpoint, load_extra_state, save_checkpoint
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import EdgeError


def tiny(preset: str = "stellarbyte") -> Decoder:
    """Seeded, with random 1-D weights (norms, LayerScale), in training mode like a model being checkpointed."""
    cfg = ModelConfig.preset_config(preset, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                    vocab_size=80, max_seq_len=32)
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("preset", ["stellarbyte", "minicpm4", "qwen2"])
def test_round_trip_is_bitwise(tmp_path, preset):
    model = tiny(preset)
    save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.source == "edgellm" and loaded.config == model.cfg and loaded.tokenizer_path is None
    assert not loaded.model.training and loaded.model.embed.weight.dtype == torch.float32
    ours, theirs = model.state_dict(), loaded.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    tokens = torch.randint(0, 80, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # same weights, same RoPE tables (rebuilt by the loader): the very same logits
        assert torch.equal(model.eval()(tokens)[0], loaded.model(tokens)[0])
    assert load_extra_state(tmp_path / "ck") is None


def test_optimizer_state_round_trip_and_atomic_replace(tmp_path):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(0))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    extra = {"optimizer": opt.state_dict(), "step": 7, "best_loss": float("inf"), "note": None}
    out = save_checkpoint(model, tmp_path / "ck", extra_state=extra, tokenizer=tok)
    assert sorted(p.name for p in out.iterdir()) == ["edgellm.json", "extra_state.json", "extra_state.safetensors",
                                                     "model.safetensors", "tokenizer.json"]
    assert load_checkpoint(out).tokenizer_path == out / "tokenizer.json"

    back = load_extra_state(out)
    assert (back["step"], back["best_loss"], back["note"]) == (7, float("inf"), None)
    saved, restored = opt.state_dict(), back["optimizer"]
    assert restored["param_groups"] == saved["param_groups"]  # int keys, tuple betas survive
    assert restored["state"].keys() == saved["state"].keys()
    for i, slots in saved["state"].items():
        assert all(torch.equal(slots[k], restored["state"][i][k]) for k in slots)
    torch.optim.AdamW(model.parameters()).load_state_dict(restored)  # torch accepts it as is

    with torch.no_grad():
        model.embed.weight.add_(1.0)
    save_checkpoint(model, out)  # replaces the old checkpoint; the old extra state goes with it
    assert torch.equal(load_checkpoint(out).model.embed.weight, model.embed.weight)
    assert load_extra_state(out) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "tokenizer.json"]  # no temp dirs left

    other = tmp_path / "not_a_checkpoint"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(EdgeError, match="refusing to replace"):
        save_checkpoint(model, other)
    assert (other / "precious.txt").read_text() == "keep me"
    with pytest.raises(EdgeError, match="cannot be saved"):
        save_checkpoint(model, tmp_path / "bad", extra_state={"sched": object()})
    assert not (tmp_path / "bad").exists()


def _edit_marker(directory: Path, **changes) -> None:
    doc = json.loads((directory / "edgellm.json").read_text())
    for key, value in changes.items():
        if key == "config":
            doc["config"].update(value)
        else:
            doc[key] = value
    (directory / "edgellm.json").write_text(json.dumps(doc))


def test_reader_rejections(tmp_path):
    good = tmp_path / "good"
    save_checkpoint(tiny(), good)
    marker = good / "edgellm.json"
    original = marker.read_text()
    cases = [
        (dict(format_version=2), "format_version 2 is not supported"),
        (dict(format="something-else"), "expected 'edgellm-checkpoint'"),
        (dict(config={"flash_attention": True}), "unknown config keys: flash_attention"),
        (dict(surprise=1), "unknown keys surprise"),
        (dict(tokenizer="../../etc/passwd"), "tokenizer must be one of"),
        (dict(tokenizer="tokenizer.json"), "tokenizer.json: missing"),
        (dict(config={"n_heads": 3}), "bad config"),
        (dict(config={"dim": 64}), "has shape"),  # config and weights disagree
    ]
    for changes, message in cases:
        marker.write_text(original)
        _edit_marker(good, **changes)
        with pytest.raises(EdgeError, match=message):
            load_checkpoint(good)
    marker.write_text("{not json")
    with pytest.raises(EdgeError, match="edgellm.json: not readable JSON"):
        load_checkpoint(good)
    marker.write_text(original)

    weights = good / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(b"\xff" * 8 + blob[8:])  # header length field corrupted
    with pytest.raises(EdgeError, match="model.safetensors"):
        load_checkpoint(good)
    weights.write_bytes(blob[:-100])
    with pytest.raises(EdgeError, match="model.safetensors"):
        load_checkpoint(good)
    weights.unlink()
    with pytest.raises(EdgeError, match="model.safetensors: missing"):
        load_checkpoint(good)


def test_dispatch_errors_name_the_path(tmp_path):
    for path in (tmp_path / "nope", tmp_path, tmp_path / "weights.pt"):
        if path.name == "weights.pt":
            path.write_bytes(b"\0" * 64)
        with pytest.raises(EdgeError, match=str(path)) as err:
            load_checkpoint(path)
        assert "expected" in str(err.value)


def test_info_cli(tmp_path, capsys):
    model = tiny("minicpm4")
    save_checkpoint(model, tmp_path / "ck")
    assert main(["info", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in model.parameters())
    assert f"parameters: {n}" in out and "source: edgellm" in out and "preset: minicpm4" in out
    assert "  scale_depth: 1.4" in out and f"size fp32: {n * 4 / 1e6:.2f} MB" in out
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "edgellm info: error:" in capsys.readouterr().err
