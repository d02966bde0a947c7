"""Any head size exports and runs (issue 21): onnxruntime's CPU GroupQueryAttention (1.22 through 1.32) takes
head sizes that are a multiple of 8, and a multiple of 16 with its RoPE inside; export rotates q/k with
RotaryEmbedding before it for the others, and zero-pads every head to the next multiple of 8 below that (the
cache rows then kv_head_dim wide, manifest format 7). Tiny seeded transformers checkpoints (6 heads / 2 kv
heads, 1 layer) of each family and head size go through load -> export -> the edgellm runtime, whose logits
and greedy tokens must be transformers' own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from edgellm.cli import main
from edgellm.export import ExportOptions, export_model
from edgellm.loaders import load_checkpoint
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from edgellm.runtime.manifest import read_manifest
from tests.export_helpers import engine_greedy

transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS = 6, 2
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
OPTIONS = dict(max_seq=64, prefill_chunk=8)
PROMPT, STEPS = 11, 12  # one full chunk + a padded one, then greedy decode steps


def save_hf(family: str, head_dim: int, out: Path) -> torch.nn.Module:
    """A seeded 1-layer transformers model with `head_dim`; llama/mistral as the usual hidden = heads * head_dim,
    qwen3 with its explicit head_dim beside a small hidden size. Norms randomised, weights scaled up so
    attention is far from uniform (a wrong rotation or scale shows)."""
    config_cls, model_cls = FAMILIES[family]
    size = dict(hidden_size=96, head_dim=head_dim) if family == "qwen3" else dict(hidden_size=HEADS * head_dim)
    config = getattr(transformers, config_cls)(
        vocab_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=128, tie_word_embeddings=False, **size)
    torch.manual_seed(head_dim)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
            else:
                p.mul_(3.0)
    hf.save_pretrained(out)
    return hf


def export(tmp: Path, family: str, head_dim: int, log: list[str] | None = None) -> tuple[torch.nn.Module, Path]:
    hf = save_hf(family, head_dim, tmp / "hf")
    loaded = load_checkpoint(tmp / "hf")
    assert loaded.config.hd == head_dim
    export_model(loaded.model, tmp / "fp32", ExportOptions(**OPTIONS), progress=False,
                 log=(log if log is not None else []).append)
    return hf, tmp / "fp32"


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def prompt_ids() -> list[int]:
    return torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


def gqa_ops(directory: Path) -> tuple[list[str], int | None]:
    """The op types of layer 0's decode graph and its GroupQueryAttention's do_rotary (None: no such node)."""
    graph = onnx.load(str(directory / "layer_0.decode.onnx"), load_external_data=False).graph
    rotary = [a.i for n in graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
              if a.name == "do_rotary"]
    return [n.op_type for n in graph.node], (rotary[0] if rotary else None)


# (family, head_dim, what the export must pick): "inside" = RoPE in GroupQueryAttention (hd % 16 == 0),
# "outside" = RotaryEmbedding ops before it (hd % 8 == 0), "padded" = heads zero-padded to a multiple of 8
CASES = [("llama", 24, "outside"), ("mistral", 40, "outside"), ("qwen3", 72, "outside"), ("llama", 80, "inside"),
         ("mistral", 96, "inside"), ("qwen3", 112, "inside"), ("llama", 128, "inside"), ("qwen3", 256, "inside"),
         ("mistral", 20, "padded"), ("qwen3", 12, "padded"), ("llama", 6, "padded")]
SLOW = {112, 256}  # the rest of the matrix keeps every family and every kind in the fast set


@pytest.mark.parametrize(("family", "head_dim", "kind"),
                         [pytest.param(*c, marks=pytest.mark.slow if c[1] in SLOW else (), id=f"{c[0]}-{c[1]}")
                          for c in CASES])
def test_head_size_exports_and_matches_transformers(tmp_path, capsys, family, head_dim, kind):
    log: list[str] = []
    hf, out = export(tmp_path, family, head_dim, log)
    m = read_manifest(out)
    record = m.export_options["attention_impl"]
    assert log[-2].split() == ["attention", *record.split()]  # the export table's line before "wrote ..."
    ops, rotary = gqa_ops(out)
    assert m.kv_layout == "inplace" and m.has_stack and m.export_options["attention"] == "fused"
    assert rotary == (kind == "inside")
    assert ops.count("RotaryEmbedding") == (0 if kind == "inside" else 2)
    assert ("RoPE inside" in record) == (kind == "inside") and ("zero-padded" in record) == (kind == "padded")
    padded = -(-head_dim // 8) * 8
    assert m.model_head_dim == head_dim and m.head_dim == (padded if kind == "padded" else head_dim)
    assert m.kv_head_dim == (padded if kind == "padded" else None)  # the recorded cache row width
    assert main(["info", str(out)]) == 0 and f"attention: {record}\n" in capsys.readouterr().out

    prompt = prompt_ids()
    got, generated, cache = engine_greedy(out, prompt, STEPS)
    assert cache.length == PROMPT + STEPS and not cache.keys[0][..., head_dim:].any()  # the padding stays zero
    want = hf_logits(hf, prompt + generated)[PROMPT - 1:]
    assert got.shape == want.shape == (STEPS + 1, 128)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    assert want[:-1].argmax(-1).tolist() == generated  # transformers' own greedy tokens
    assert len(set(generated)) > 1  # a constant model would make the token check vacuous


@pytest.mark.parametrize(("family", "head_dim", "fmt"), [("llama", 24, "fast"), ("mistral", 20, "fast"),
                                                         pytest.param("mistral", 20, "portable", marks=pytest.mark.slow)])
def test_int4_on_odd_head_sizes(tmp_path, family, head_dim, fmt):
    """int4 (group 32: the attention width 6 * 24 = 144 is no multiple of it; 20 pads to 6 * 24 too) quantizes
    and runs: the runtime's logits stay close to transformers' on the same tokens (cosine > 0.9 at every step;
    ~0.92-0.97 measured) and its greedy picks are among transformers' top 5. The cache layout carries over."""
    hf, out = export(tmp_path, family, head_dim)
    quantize_export(out, tmp_path / "q4", QuantizeOptions(bits=4, group_size=32, format=fmt), check=False,
                    progress=False, log=lambda _: None)
    src, q = read_manifest(out), read_manifest(tmp_path / "q4")
    assert q.export_options["attention_impl"] == src.export_options["attention_impl"]
    assert q.kv_head_dim == src.kv_head_dim and q.head_dim == src.head_dim
    prompt = prompt_ids()
    got, generated, _ = engine_greedy(tmp_path / "q4", prompt, STEPS)
    want = hf_logits(hf, prompt + generated)[PROMPT - 1:]
    assert np.isfinite(got).all()
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() > 0.9, cos
    top5 = np.argsort(want, -1)[:, -5:]  # random tiny weights leave small margins: the pick is among the top 5
    assert np.mean([g in t for g, t in zip(got.argmax(-1), top5, strict=True)]) >= 0.8
