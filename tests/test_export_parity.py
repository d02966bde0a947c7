"""Exported graphs vs PyTorch, for every preset and both granularities, and for transformers checkpoints:
chunked prefill (prompt not a multiple of the chunk) + 32 greedy decode steps through onnxruntime with the
KVCache rule must match the full forward's logits within 1e-4 and pick the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.export import ExportOptions, export_model
from edgellm.loaders import load_checkpoint
from edgellm.model import PRESETS
from tests.export_helpers import onnx_generate_logits, tiny_model, torch_logits

OPTIONS = dict(max_seq=64, prefill_chunk=8)
PROMPT = 19  # 2 full chunks + 3 real rows in a padded third
STEPS = 32


def check_parity(out, reference, vocab: int) -> None:
    prompt = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(7)).tolist()
    got, generated = onnx_generate_logits(out, prompt, STEPS)
    want = reference(prompt + generated)
    assert got.shape == want.shape == (PROMPT + STEPS, vocab)
    assert np.abs(got - want).max() < 1e-4
    # the same greedy tokens: the full forward's argmax at every position that generated one
    assert want[PROMPT - 1:-1].argmax(-1).tolist() == generated
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert len(set(want.argmax(-1).tolist())) > 1  # a constant model would make the token checks vacuous


FAST = {("llama2", "layer"), ("minicpm4", "model")}  # the rest of the matrix is marked slow (~12 s each)
CASES = [pytest.param(p, g, marks=() if (p, g) in FAST else pytest.mark.slow, id=f"{p}-{g}")
         for p in PRESETS for g in ("layer", "model")]


@pytest.mark.parametrize(("preset", "granularity"), CASES)
def test_every_preset_matches_pytorch(tmp_path, preset, granularity):
    model = tiny_model(preset, seed=3)
    manifest = export_model(model, tmp_path / "out", ExportOptions(granularity=granularity, **OPTIONS),
                            progress=False, log=lambda _: None)
    assert max(manifest.verification.values()) < 1e-4
    check_parity(tmp_path / "out", lambda t: torch_logits(model, t), model.cfg.vocab_size)


transformers = pytest.importorskip("transformers")
HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(HF))
def test_transformers_checkpoint_matches_transformers(tmp_path, family):
    """HF config -> save_pretrained -> edgellm.loaders -> export; compared with transformers' own logits."""
    config_cls, model_cls, extra = HF[family]
    config = getattr(transformers, config_cls)(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:  # norms are 1 and biases 0 at init: randomise so a dropped one is caught
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
            else:
                p.mul_(4.0)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_checkpoint(tmp_path / "hf")
    export_model(loaded.model, tmp_path / "out", ExportOptions(**OPTIONS), loaded.tokenizer_path,
                 progress=False, log=lambda _: None)

    def reference(tokens):
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0].numpy()

    check_parity(tmp_path / "out", reference, 256)
