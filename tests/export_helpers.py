"""Shared by the export tests (and usable by the runtime tests as a reference loop): tiny seeded models and
an onnxruntime prefill + greedy decode over an export directory, written independently of edgellm.export
from design.md (file names, graph I/O, KV-cache rule) and the manifest alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.kvcache import KVCache, embed_feeds, plan_calls, step_feeds
from edgellm.runtime.manifest import read_manifest

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


def _sessions(directory: Path, graphs, opts: ort.SessionOptions | None = None) -> dict[str, ort.InferenceSession]:
    if opts is None:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
    return {g.name: ort.InferenceSession(str(directory / g.file), opts, providers=["CPUExecutionProvider"])
            for g in graphs}


def _step(sess: dict, manifest, cache: KVCache, tokens: Sequence[int], seq: int) -> np.ndarray:
    """One graph call on up to `seq` tokens (padded); writes the real rows; logits [len(tokens), V]."""
    n, kind = len(tokens), "decode" if seq == 1 else "prefill"
    ids = np.zeros((1, seq), np.int64)
    ids[0, :n] = tokens
    start, layout = cache.length, manifest.kv_layout
    position = step_feeds(layout, start, seq, manifest.max_seq)
    if manifest.granularity == "model":
        feeds = {"tokens": ids, **position}
        for i in range(manifest.n_layers):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache.keys[i], cache.values[i]
        names = [o.name for o in manifest.graph("model", seq).outputs]
        out = dict(zip(names, sess[f"model.{kind}"].run(names, feeds), strict=True))
        for i in range(manifest.n_layers):
            cache.write(i, out[f"present_key.{i}"], out[f"present_value.{i}"], n)
        logits = out["logits"]
    else:
        hidden = sess[f"embed.{kind}"].run(["hidden"], {
            "tokens": ids, **embed_feeds(manifest.dims.embed_positions, start, seq, manifest.max_seq)})[0]
        for i in range(manifest.n_layers):
            hidden, k, v = sess[f"layer_{i}.{kind}"].run(
                ["hidden_out", f"present_key.{i}", f"present_value.{i}"],
                {"hidden": hidden, **position, f"past_key.{i}": cache.keys[i], f"past_value.{i}": cache.values[i]})
            cache.write_present(i, layout, k, v, n)
        logits = sess[f"head.{kind}"].run(["logits"], {"hidden": hidden})[0]
    cache.advance(n)
    return logits[0, :n]


def onnx_generate_logits(directory: Path, tokens: Sequence[int], steps: int = 0,
                         opts: ort.SessionOptions | None = None) -> tuple[np.ndarray, list[int]]:
    """Prefill `tokens` in prefill_chunk pieces (the last one padded), then `steps` greedy decode steps.

    Returns (logits [len(tokens) + steps, V], one row per position fed; the `steps` greedy tokens fed back).
    Row len(tokens)-1+k predicts generated token k, so the full forward on tokens + generated must match.
    """
    directory = Path(directory)
    m = read_manifest(directory)
    sess = _sessions(directory, m.graphs, opts)
    cache = KVCache(m.n_layers, m.n_kv_heads, m.max_seq, m.head_dim, rows=m.dims.rows)
    chunk = m.prefill_chunk
    rows = [_step(sess, m, cache, tokens[i:i + count], seq)
            for i, count, seq in plan_calls(len(tokens), chunk, 0, m.max_seq, m.kv_layout)]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(np.argmax(rows[-1][-1])))
        rows.append(_step(sess, m, cache, generated[-1:], 1))
    return np.concatenate(rows), generated


def torch_logits(model: Decoder, tokens: Sequence[int]) -> np.ndarray:
    """The full forward (no cache) on `tokens`: logits [T, V]."""
    with torch.no_grad():
        return model(torch.tensor([list(tokens)]))[0][0].numpy()


def engine_greedy(directory: Path, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], KVCache]:
    """The runtime's engine (stack graph where the export has one, 1 thread): the prompt, then `steps` greedy
    steps; the logits that picked each token [steps + 1, V], the tokens and the cache."""
    from edgellm.runtime import Generator
    from edgellm.runtime.session import SessionConfig

    engine = Generator.open(directory, config=SessionConfig(threads=1)).engine
    rows = [engine.forward(prompt).copy()]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(rows[-1].argmax()))
        rows.append(engine.forward(generated[-1:]).copy())
    return np.stack(rows), generated, engine.cache
