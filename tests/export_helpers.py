"""Shared by the export tests: tiny seeded models, and prefill + greedy decode over an export directory through
the runtime's Engine (every row's logits, to compare with the PyTorch model's full forward)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.engine import Engine
from edgellm.runtime.kvcache import KVCache
from edgellm.runtime.manifest import read_manifest
from edgellm.runtime.session import SessionConfig

TINY = dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=256)
# per-preset changes so every feature is live at max_seq 64: MiniCPM's width scaling (dim_model_base < dim)
# and LongRoPE's long factors + attention scaling (context 64 > rope_original_max); Qwen3's explicit head_dim;
# Gemma 3's sliding window (layer 0 sliding with a ring cache, layer 1 full) and a softmax scale of its own
PRESET_TWEAKS = {"minicpm4": dict(dim_model_base=32, rope_original_max=32), "qwen3": dict(head_dim=16),
                 "stellarbyte": dict(xpos_scale_base=64.0),
                 "gemma3": dict(head_dim=16, sliding_window=6, attn_scale=0.2)}


def tiny_model(preset: str, seed: int = 0, **over) -> Decoder:
    """A seeded tiny Decoder whose 1-D weights (norms, LayerScale, biases) are random too, so a graph that
    drops or swaps one of them fails the comparison; 2-D weights are scaled up for non-trivial attention."""
    cfg = ModelConfig.preset_config(preset, **{**TINY, **PRESET_TWEAKS.get(preset, {}), **over})
    model = Decoder(cfg)
    model.reset_parameters(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.mul_(4.0)
    return model.eval()


def default_export(out: Path) -> Path:
    """`out`: the default export (fused layers, stack and lone-row stack) of tiny_model("llama2", seed=0), max_seq 64,
    prefill chunk 8."""
    from edgellm.export import ExportOptions, export_model

    export_model(tiny_model("llama2", seed=0), out, ExportOptions(max_seq=64, prefill_chunk=8), progress=False,
                 log=lambda _: None)
    return out


def onnx_generate_logits(directory: Path, tokens: Sequence[int], steps: int = 0,
                         config: SessionConfig | None = None) -> tuple[np.ndarray, list[int]]:
    """The runtime's Engine (layer graphs, not the stack, unless `config` says otherwise) feeds `tokens` as one
    prompt (prefill_chunk pieces, the last one padded), then `steps` greedy tokens one at a time.

    Returns (logits [len(tokens) + steps, V], one row per position fed; the `steps` greedy tokens fed back).
    Row len(tokens)-1+k predicts generated token k, so the full forward on tokens + generated must match.
    """
    engine = Engine.open(Path(directory), read_manifest(directory), config or SessionConfig(stack=False))
    rows = [engine.forward_rows(list(tokens))]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(np.argmax(rows[-1][-1])))
        rows.append(engine.forward_rows(generated[-1:]))
    return np.concatenate(rows), generated


def torch_logits(model: Decoder, tokens: Sequence[int]) -> np.ndarray:
    """The full forward (no cache) on `tokens`: logits [T, V]."""
    with torch.no_grad():
        return model(torch.tensor([list(tokens)]))[0][0].numpy()


def engine_greedy(directory: Path, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], KVCache]:
    """The runtime's engine (stack graph where the export has one, 1 thread): the prompt, then `steps` greedy
    steps; the logits that picked each token [steps + 1, V], the tokens and the cache."""
    from edgellm.runtime import Generator

    engine = Generator.open(directory, config=SessionConfig(threads=1)).engine
    rows = [engine.forward(prompt).copy()]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(rows[-1].argmax()))
        rows.append(engine.forward(generated[-1:]).copy())
    return np.stack(rows), generated, engine.cache


def greedy_steps(engine, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding through `engine`, one S = 1 step per token: (the n tokens fed, their steps' logits
    [n, V]); the cache is then rewound to the prompt, ready to feed the same tokens as verifications."""
    logits, fed, steps = engine.forward(prompt).copy(), [], []
    for _ in range(n):
        fed.append(int(logits.argmax()))
        logits = engine.forward(fed[-1:]).copy()
        steps.append(logits)
    engine.cache.rewind(len(prompt))
    return fed, np.stack(steps)


def assert_exact_speculation(directory, prompt: list[int]):
    """Through the spare-row stack (`SessionConfig(exact=True)`: what a Generator decodes through once speculation
    is on): 16 greedy decode steps equal their rows of verifications of 8,
    bit for bit, and greedy lookup speculation gives plain decoding's 32 tokens (accepting some drafts); or, where
    this CPU's 4-bit kernel computes a lone row differently, the runtime's probe sees it (rows_helpers.py).
    Returns the Engine."""
    from edgellm.runtime.engine import Engine
    from edgellm.runtime.generator import Generator
    from edgellm.runtime.manifest import read_manifest
    from edgellm.runtime.sampling import SamplingParams, StopParams
    from tests.rows_helpers import assert_rows_exact

    engine = Engine.open(directory, read_manifest(directory), SessionConfig(exact=True))
    fed, steps = greedy_steps(engine, prompt, 16)
    rows = np.concatenate([engine.few_rows(fed[i:i + 8]).copy() for i in range(0, len(fed), 8)])
    assert engine.exact_rows
    if not assert_rows_exact(engine, rows, steps):    # this CPU's 4-bit kernel (tests/rows_helpers.py)
        return engine
    gen, greedy = Generator.open(directory, config=SessionConfig(exact=True)), SamplingParams(temperature=0)
    plain = gen.complete(prompt, greedy, StopParams(32), ignore_eos=True, text=False).token_ids
    gen.speculate("lookup", timed=False)
    spec = gen.complete(prompt, greedy, StopParams(32), ignore_eos=True, text=False)
    assert spec.token_ids == plain and spec.speculative["accepted"] > 0
    return engine
