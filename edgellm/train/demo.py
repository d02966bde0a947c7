"""The demo's training stage: generated stories -> byte-level BPE -> a small model, in a budget.

`train_demo(out, budget_s, seed, size)` leaves a native checkpoint in `out` (with tokenizer.json) that
`edgellm export` reads, and reports the validation loss next to the unigram entropy of the validation
tokens (the loss of the best guess that ignores context) plus a sampled continuation.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgellm.loaders import load_checkpoint
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import need

from .bpe import train_bpe
from .checkpoint import DATA_DIR, is_complete
from .corpus import generate_corpus, story
from .data import build_token_file, file_sha256
from .loop import TrainConfig, TrainResult, train

# size -> corpus, tokenizer, architecture preset, model and run shape. "small" is the default demo (<= ~3 min
# on 2 cores); "tiny" is the same pipeline in a few seconds (tests); "medium" is a ~3.4 M-parameter qwen3-preset
# model (qk-norm, GQA, tied embeddings) for the quantization benchmark (~8 min: pass budget_s=480).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(stories=1500, vocab=384, preset="llama2",
                 model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176, max_seq_len=128),
                 train=dict(steps=40, batch_size=8, seq_len=64, lr=3e-3, min_lr=3e-4, warmup=5, eval_every=20,
                            eval_steps=2, save_every=1000)),
    "small": dict(stories=30000, vocab=768, preset="llama2",
                  model=dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=4, hidden_dim=512, max_seq_len=256),
                  train=dict(steps=2000, batch_size=8, seq_len=128, lr=5e-3, min_lr=5e-4, warmup=30,
                             eval_every=200, eval_steps=16, save_every=500)),
    "medium": dict(stories=50000, vocab=1024, preset="qwen3",
                   model=dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=768,
                              max_seq_len=256),
                   train=dict(steps=4000, batch_size=8, seq_len=128, lr=3e-3, min_lr=3e-4, warmup=50,
                              eval_every=250, eval_steps=16, save_every=1000)),
}
PROMPT_SENTENCES = 3  # the sample continues the first sentences of a story the model never saw


@dataclass
class DemoResult:
    out: Path  # the checkpoint directory
    tokenizer: Path
    val_loss: float
    unigram_entropy: float
    prompt: str
    sample: str  # the model's continuation of `prompt`
    n_params: int
    train: TrainResult


def train_demo(out: Path, budget_s: float = 170.0, seed: int = 0, size: str = "small",
               progress: bool = True) -> DemoResult:
    """Corpus -> tokenizer -> model, trained for its step count or until `budget_s` (all stages) runs out."""
    need(size in SIZES, f"unknown demo size {size!r}; expected one of {', '.join(SIZES)}")
    spec = SIZES[size]
    t0 = time.perf_counter()
    out = Path(out)
    if is_complete(out) and (out / DATA_DIR / "corpus.txt").is_file():
        shutil.rmtree(out)  # a previous demo's output: start over
    corpus = out / DATA_DIR / "corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("\n\n".join(generate_corpus(spec["stories"], seed)) + "\n", encoding="utf-8")

    tok_path = out / "tokenizer.json"
    tok = train_bpe([corpus], spec["vocab"], tok_path)
    data = build_token_file([corpus], out / DATA_DIR / "tokens.bin", tok.vocab_size, tok, file_sha256(tok_path))
    model_cfg = ModelConfig.preset_config(spec["preset"], vocab_size=tok.vocab_size, bos_id=tok.bos_id,
                                          eos_id=tok.eos_id, **spec["model"])

    def left() -> float:  # seconds left for training; 5 s are kept for the sample
        return max(budget_s - (time.perf_counter() - t0) - 5.0, 1.0)

    cfg = TrainConfig(seed=seed, **spec["train"])  # `steps` is a cap: the loop fits the run to the budget
    cfg = dataclasses.replace(cfg, threads=_pick_threads(model_cfg, cfg), time_budget_s=left())
    result = train(cfg, model_cfg, data, out, progress=progress)

    prompt = " ".join(_sentences(story(random.Random(seed + 10_000)))[:PROMPT_SENTENCES])
    model = load_checkpoint(out).model  # what export will read: proves the checkpoint round-trips
    sample = continue_text(model, tok, prompt, max_new=80, seed=seed)
    return DemoResult(out=out, tokenizer=tok_path, val_loss=result.val_loss, unigram_entropy=result.unigram_entropy,
                      prompt=prompt, sample=sample, n_params=result.n_params, train=result)


def _pick_threads(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """All cores or one, whichever trains this shape faster right now: on a busy machine spinning OpenMP
    threads can be several times slower than a single one."""
    torch.manual_seed(0)
    model = Decoder(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    best = (float("inf"), 1)
    for threads in sorted({1, os.cpu_count() or 1}):  # one thread first: its time bounds the others' trial
        torch.set_num_threads(threads)
        times: list[float] = []
        for i in range(3):
            t = time.perf_counter()
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            if i > 0 and times[-1] > 1.5 * best[0]:
                break  # clearly slower than the best so far
        best = min(best, (min(times[1:]), threads))
    return best[1]


@torch.no_grad()
def continue_text(model: Decoder, tok: Any, prompt: str, max_new: int, seed: int, temperature: float = 0.7,
                  top_k: int = 20) -> str:
    """Sample a continuation of `prompt` (BOS + prompt ids) until EOS or `max_new` tokens; returns the new text."""
    gen = torch.Generator().manual_seed(seed)
    ids = [tok.bos_id, *tok.encode(prompt)]
    new: list[int] = []
    for _ in range(max_new):
        context = torch.tensor([ids[-model.cfg.max_seq_len :]])
        logits = model(context)[0][0, -1] / temperature  # [V]
        kth = torch.topk(logits, top_k).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt == tok.eos_id:
            break
        ids.append(nxt)
        new.append(nxt)
    return tok.decode(new)


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text)
