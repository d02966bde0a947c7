"""Exports shared by the runtime tests (test_runtime*, test_cli_run, test_arm64), each built once per session.

`bigram` is a model whose next token depends on the current token only (its layer's output projections are
zero, so every block is the identity): its lm_head is set so greedy decoding walks a chosen chain of
byte-level tokens. With a byte-level tokenizer that chain splits UTF-8 characters across tokens and ends in
EOS, so streaming, stop strings and EOS are checked on real onnxruntime output.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from edgellm.export import ExportOptions, export_model
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.tokenizer import BYTE_TO_UNICODE
from tests.export_helpers import tiny_model

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1 (BOS), 2 (EOS)
BYTE_BASE = len(SPECIALS)            # byte b is token BYTE_BASE + index of its symbol in the sorted alphabet
START = "a"                          # the prompt after BOS
CHAIN = "é中!"                        # then: c3 a9 | e4 b8 ad | 21, then EOS
OPTIONS = dict(max_seq=64, prefill_chunk=8)


def write_byte_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE with no merges: one token per byte (259 tokens); Llama-style, it puts <s> in front."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return tok


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    return [tok.token_to_id(BYTE_TO_UNICODE[b]) for b in text.encode("utf-8")]


def bigram_model(tok: Tokenizer) -> Decoder:
    cfg = ModelConfig.preset_config("llama2", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                    vocab_size=tok.get_vocab_size(), max_seq_len=64)
    model = Decoder(cfg)
    model.reset_parameters(seed=0)
    path = byte_ids(tok, START + CHAIN) + [2]  # ... -> "!" -> EOS
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.layers[0].attn.o.weight.zero_()
        model.layers[0].mlp.down.weight.zero_()
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=gen))
        model.lm_head.weight.zero_()
        for here, nxt in zip(path, path[1:], strict=False):
            x = model.embed.weight[here]
            model.lm_head.weight[nxt] += 8.0 * x / x.pow(2).mean().sqrt()  # 8 * rmsnorm(embed[here])
    return model.eval()


def _once(tmp_path_factory, name: str) -> tuple[Path, bool]:
    out = tmp_path_factory.getbasetemp() / "runtime-exports" / name
    return out, (out / "manifest.json").is_file()


def bigram_export(tmp_path_factory) -> Path:
    """The bigram model with its byte tokenizer, layer granularity."""
    out, done = _once(tmp_path_factory, "bigram")
    if not done:
        out.parent.mkdir(parents=True, exist_ok=True)
        tok_path = out.parent / "bigram-tokenizer.json"
        tok = write_byte_tokenizer(tok_path)
        export_model(bigram_model(tok), out, ExportOptions(**OPTIONS), tok_path, progress=False, log=lambda _: None)
    return out


def tiny_export(tmp_path_factory, preset: str, granularity: str) -> tuple[Path, Decoder]:
    """`tests.export_helpers.tiny_model(preset, seed=3)` exported (max_seq 64, prefill chunk 8)."""
    model = tiny_model(preset, seed=3)
    out, done = _once(tmp_path_factory, f"{preset}-{granularity}")
    if not done:
        export_model(model, out, ExportOptions(granularity=granularity, **OPTIONS), progress=False,
                     log=lambda _: None)
    model.set_context_len(OPTIONS["max_seq"])
    return out, model


def torch_greedy(model: Decoder, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the full forward (no cache), one position at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return ids[len(prompt):]


def manifest_json(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())
