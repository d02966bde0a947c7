"""Gemma 3 text (`gemma3_text`, issue 23): seeded transformers Gemma3ForCausalLM models built from configs here
(odd sizes, GQA, query_pre_attn_scalar != head_dim, sliding layers with a small window beside full ones,
rope_parameters per layer type) load into edgellm with transformers' logits; exported, the runtime generates
transformers' greedy tokens well past the window, with window-sized ring caches for the sliding layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.export import ExportOptions, export_model
from edgellm.loaders import load_checkpoint
from edgellm.quant.export_dir import quantize_export
from edgellm.quant.options import QuantizeOptions
from edgellm.runtime import Generator
from edgellm.runtime.errors import EdgeError
from edgellm.runtime.graphio import SPARE_ROWS
from edgellm.runtime.manifest import read_manifest
from tests.export_helpers import engine_greedy

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 160, 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma_config(head_dim: int = 32, **over) -> transformers.Gemma3TextConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=56, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=WINDOW,
                  layer_types=TYPES, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    return transformers.Gemma3TextConfig(**{**fields, **over})


def save_gemma(out: Path, seed: int = 0, **over) -> torch.nn.Module:
    """A seeded Gemma3ForCausalLM saved to `out`: norm weights spread around 0 (gain 1 + w), matrices scaled up
    so attention is far from uniform and a wrong window, scale or RoPE base shows."""
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(gemma_config(**over)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.mul_(2.5)
    hf.save_pretrained(out)
    return hf


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("head_dim", [32, 256])
def test_logits_match_transformers(tmp_path, head_dim):
    hf = save_gemma(tmp_path / "hf", head_dim=head_dim)
    loaded = load_checkpoint(tmp_path / "hf")
    cfg = loaded.config
    assert (cfg.preset, cfg.layer_types, cfg.sliding_window) == ("gemma3", ("sliding", "sliding", "full", "sliding"),
                                                                  WINDOW)
    assert cfg.attn_scale == 24 ** -0.5 and cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 windows
    want = hf_logits(hf, tokens)
    with torch.no_grad():
        got = loaded.model(torch.tensor([tokens]))[0][0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))


def test_refuses_multimodal_and_softcapping(tmp_path):
    save_gemma(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    import json
    original = json.loads(cfg_path.read_text())
    for change, message in (({"model_type": "gemma3"}, "multimodal"),
                            ({"final_logit_softcapping": 30.0}, "softcapping"),
                            ({"hidden_activation": "relu"}, "hidden_activation")):
        cfg_path.write_text(json.dumps({**original, **change}))
        with pytest.raises(EdgeError, match=message):
            load_checkpoint(tmp_path / "hf")


OPTIONS = dict(max_seq=64, prefill_chunk=8)
PROMPT, STEPS = 11, 30  # a full chunk + a padded one, then greedy steps to position 41: five windows of 8


def export(tmp: Path, granularity: str = "layer", attention: str = "fused",
           **over) -> tuple[torch.nn.Module, Path, list[str]]:
    hf = save_gemma(tmp / "hf", **over)
    log: list[str] = []
    loaded = load_checkpoint(tmp / "hf")
    export_model(loaded.model, tmp / "fp32", ExportOptions(granularity=granularity, attention=attention, **OPTIONS),
                 progress=False, log=log.append)
    return hf, tmp / "fp32", log


def prompt_ids() -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize(("granularity", "attention"), [
    ("layer", "fused"), ("layer", "standard"), pytest.param("model", "standard", marks=pytest.mark.slow)])
def test_export_greedy_matches_transformers_past_the_window(tmp_path, granularity, attention):
    """Sliding layers keep rings: window rows (traced layers: the runtime writes after the graph read), or window
    + prefill_chunk - 1 (fused layers write the chunk in place before reading); the full layer max_seq rows (+ 1: fused attention's extra row)."""
    hf, out, log = export(tmp_path, granularity, attention)
    m = read_manifest(out)
    ring = WINDOW + (OPTIONS["prefill_chunk"] - 1 if attention == "fused" else 0)
    full = 64 + (SPARE_ROWS if attention == "fused" else 0)  # fused attention's extra row (graphio.SPARE_ROWS)
    assert m.kv_cache_rows == (ring, ring, full, ring)
    assert m.kv_layout == ("inplace" if attention == "fused" else "rows") and m.has_stack == (attention == "fused")
    assert ("ring cache" in m.export_options["attention_impl"]) == (attention == "fused")
    layer0 = next(g for g in m.graphs if g.name == ("layer_0.decode" if granularity == "layer" else "model.decode"))
    assert next(t for t in layer0.inputs if t.name == "past_key.0").shape == (1, 1, ring, 32)
    got, generated, _ = engine_greedy(out, prompt_ids(), STEPS)
    want = hf_logits(hf, prompt_ids() + generated)[PROMPT - 1:]
    assert got.shape == want.shape == (STEPS + 1, VOCAB)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    assert want[:-1].argmax(-1).tolist() == generated  # transformers' own greedy tokens, 41 positions deep
    assert len(set(generated)) > 3


@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_quantized_export_runs_past_the_window(tmp_path, bits):
    """int4/int8 (the tied 160 x 72 embedding included) quantize the ring-cache export and run: the cache layout
    carries over and the logits stay close to transformers' on the same tokens (cosine per step)."""
    hf, out, _ = export(tmp_path)
    log: list[str] = []
    quantize_export(out, tmp_path / "q", QuantizeOptions(bits=bits, group_size=32), check=False, progress=False,
                    log=log.append)
    q = read_manifest(tmp_path / "q")
    assert q.kv_cache_rows == read_manifest(out).kv_cache_rows and q.quantization is not None
    got, generated, _ = engine_greedy(tmp_path / "q", prompt_ids(), STEPS)
    want = hf_logits(hf, prompt_ids() + generated)[PROMPT - 1:]
    assert np.isfinite(got).all()
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    # int8: > 0.99 everywhere; int4 on these sharp random weights (x 2.5): mean ~0.9, min 0.68 measured
    assert cos.min() > (0.6 if bits == 4 else 0.99) and cos.mean() > (0.85 if bits == 4 else 0.99), cos


def test_gguf_gemma3_matches_transformers_gguf_load(tmp_path):
    """A gemma3 GGUF written as llama.cpp's converter writes it (norms stored as 1 + w, SentencePiece vocabulary)
    loads equal to transformers' own GGUF load: 7 layers so the fixed 5:1 pattern has a full layer, 20 tokens
    past the window of 8, head_dim 256 (= transformers' default query_pre_attn_scalar, which GGUF does not carry)."""
    from tests.gguf_helpers import hf_model, reference, spm_vocab, write_gguf

    v = spm_vocab()
    model = hf_model("gemma3", len(v["tokens"]), num_hidden_layers=7, head_dim=256, sliding_window=WINDOW,
                     tie_word_embeddings=True, rms_norm_eps=1e-6)
    path = write_gguf(tmp_path / "g.gguf", model, "gemma3", v)
    ref, _ = reference(path)
    loaded = load_checkpoint(path)
    cfg = loaded.config
    assert cfg.layer_types == ("sliding",) * 5 + ("full", "sliding") and cfg.sliding_window == WINDOW
    tokens = torch.randint(3, len(v["tokens"]), (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got, _ = loaded.model(tokens)
        assert (model(tokens).logits - want).abs().max().item() <= 1e-4  # the file holds the original model
    assert (want - got).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_info_and_ring_rewind(tmp_path, capsys):
    """`edgellm info` reports the ring caches; a ring cache rewinds only to 0 or its length, and chat feeds the
    whole conversation again (the generator falls back to 0)."""
    from edgellm.cli import main
    from edgellm.runtime.kvcache import KVCache

    _, out, _ = export(tmp_path)
    assert main(["info", str(out)]) == 0
    assert "3 sliding-window layers keep rings of 15 rows" in capsys.readouterr().out
    cache = KVCache(2, 1, 64, 4, rows=(8, 64))
    cache.advance(20)
    assert cache.can_rewind(20) and cache.can_rewind(0) and not cache.can_rewind(12)
    with pytest.raises(EdgeError, match="ring caches"):
        cache.rewind(12)
    full = KVCache(2, 1, 64, 4)
    full.advance(20)
    assert full.can_rewind(12)  # full-length caches rewind anywhere


def test_write_ring_keeps_the_last_rows_at_their_slots():
    """write_ring puts position p in row p % R; chunks longer than the ring keep their last R positions."""
    from edgellm.runtime.kvcache import write_ring

    ring = np.full((1, 1, 5, 1), -1.0, np.float32)
    start = 0
    for count in (3, 1, 7, 1, 2):  # 14 positions: values = positions
        rows = np.arange(start, start + count, dtype=np.float32).reshape(1, 1, count, 1)
        write_ring(ring, np.concatenate([rows, np.full((1, 1, 2, 1), 99.0, np.float32)], 2), start, count)
        start += count
    assert ring[0, 0, :, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 9.0]  # positions 9..13 at p % 5; no padding


GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
                  "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
                  "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
                  "{% endif %}")


def test_chat_on_ring_caches_matches_transformers(tmp_path):
    """`edgellm export` of a Gemma 3 directory with a tokenizer and a Gemma-style chat template; chat turns on the
    ring caches (prompts of 80+ tokens, 10 windows) give transformers' greedy tokens; a follow-up turn continues
    the cache, an edited conversation (which would need a rewind the rings cannot do) is fed whole; both equal a
    fresh generator."""
    import json
    import shutil

    from edgellm.cli import main
    from edgellm.runtime.sampling import SamplingParams, StopParams
    from tests.test_chat import chat_tokenizer

    hf = save_gemma(tmp_path / "hf", vocab_size=272, bos_token_id=3, eos_token_id=2)
    chat_tokenizer(tmp_path / "tok.json")
    shutil.copy(tmp_path / "tok.json", tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA_TEMPLATE}))
    assert main(["export", str(tmp_path / "hf"), "-o", str(tmp_path / "exp"), "--max-seq", "256",
                 "--prefill-chunk", "8", "--no-progress"]) == 0
    greedy, stop = SamplingParams(temperature=0), StopParams(6, seed=0)
    gen = Generator.open(tmp_path / "exp", threads=1)
    turn = [{"role": "user", "content": "Hi there, what is 2+2?"}]
    first = list(gen.chat(turn, greedy, stop))[-1]
    ids = gen.chat_ids(turn)
    assert ids[0] == 3 and len(ids) > 4 * WINDOW
    want = hf_logits(hf, ids + first.token_ids)[len(ids) - 1:-1].argmax(-1).tolist()
    assert first.token_ids == want and len(first.token_ids) == 6
    messages = turn + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3+3?"}]
    second = list(gen.chat(messages, greedy, stop))[-1]  # continues the cache: nothing to rewind
    assert second.timings.prompt_tokens == len(gen.chat_ids(messages)) - len(ids) - 5
    fresh = lambda m: list(Generator.open(tmp_path / "exp", threads=1).chat(m, greedy, stop))[-1]  # noqa: E731
    assert second.token_ids == fresh(messages).token_ids
    edited = [{"role": "user", "content": "Hi there"}] + messages[1:]  # an earlier turn changed: rings cannot rewind
    third = list(gen.chat(edited, greedy, stop))[-1]
    assert third.timings.prompt_tokens == len(gen.chat_ids(edited)) and third.token_ids == fresh(edited).token_ids
    # and `edgellm diff` against the checkpoint: 48 tokens through ring caches, per-layer K/V rows included
    assert main(["diff", str(tmp_path / "hf"), str(tmp_path / "exp"), "-o", str(tmp_path / "r"), "--tokens", "48",
                 "--prompts", "1", "--continuation", "24", "--quiet", "--fail-if", "top1<0.99"]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    layers = report["variants"][0]["per_layer"]["layers"]
    assert max(layer[kv]["max_abs"] for layer in layers for kv in ("key", "value")) < 1e-3


def test_info_on_a_checkpoint_prints_the_layer_types(tmp_path, capsys):
    """`edgellm info` on a Gemma 3 checkpoint of 8 layers shows the ends of its layer types (strings: a long list
    of numbers is shown the same way)."""
    from edgellm.cli import main

    save_gemma(tmp_path / "hf", num_hidden_layers=8, layer_types=TYPES * 2)
    assert main(["info", str(tmp_path / "hf")]) == 0
    assert "layer_types: [sliding, sliding, full, ..., full, sliding] (8 values)" in capsys.readouterr().out
