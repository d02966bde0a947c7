"""The training loop: AdamW, warmup + cosine, clipping, accumulation, validation, exact resume, DDP."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import EdgeError, need

from . import checkpoint, ddp
from .data import TokenFile, WindowSampler, eval_offsets, unigram_entropy, windows
from .schedule import lr_at


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # optimizer steps of the whole run (the schedule's length)
    batch_size: int = 16  # windows per micro-step per process; global batch = batch_size * world
    seq_len: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    grad_accum: int = 1  # micro-steps per optimizer step
    clip: float = 1.0  # max global grad norm; 0 = off
    weight_decay: float = 0.1  # on matrices only (norm gains, biases and LayerScale are 1-D: no decay)
    beta1: float = 0.9
    beta2: float = 0.95
    eval_every: int = 100
    eval_steps: int = 8  # validation batches (of the global batch size) per evaluation
    save_every: int = 500
    seed: int = 1337
    val_fraction: float = 0.05  # the held-out tail of the tokens
    # Fit the run to this much wall time: at the end of warmup (which does not depend on the run's length)
    # `steps` is cut to what the measured speed allows, so the cosine still ends at min_lr; the loop also
    # stops (and checkpoints) once the time is up. The fitted `steps` is saved, so a resume keeps it.
    time_budget_s: float | None = None
    threads: int | None = None  # torch threads per process; None: the machine's cores / local processes

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_steps", "save_every"):
            need(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        need(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr <= --lr and --lr > 0, got "
             f"lr={self.lr} min_lr={self.min_lr}")
        need(self.clip >= 0, f"--clip must be >= 0, got {self.clip}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        need(not unknown, f"unknown train config keys: {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    out: Path
    steps: int
    tokens: int  # training tokens seen (all processes)
    train_loss: float  # mean of the last few steps' losses
    val_loss: float
    unigram_entropy: float  # nats per validation token under its own unigram distribution
    wall_s: float
    n_params: int
    losses: list[float]  # per optimizer step, the whole run (resumes included)
    evals: list[tuple[int, float]]  # (step, validation loss)

    @property
    def val_ppl(self) -> float:
        return math.exp(self.val_loss)

    def summary(self) -> str:
        return (f"trained {self.steps} steps, {self.tokens:,} tokens, {self.n_params:,} params in {self.wall_s:.1f} s: "
                f"train loss {self.train_loss:.4f}, val loss {self.val_loss:.4f} (ppl {self.val_ppl:.2f}), "
                f"unigram entropy {self.unigram_entropy:.4f} nats -> {self.out}")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices decay, 1-D parameters (norm gains, biases, LayerScale) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def train(cfg: TrainConfig, model_cfg: ModelConfig, data: TokenFile, out: Path, *, resume: bool = False,
          until: int | None = None, progress: bool = True) -> TrainResult:
    """Train a `Decoder(model_cfg)` on `data` into the checkpoint directory `out`.

    `until` stops at that step (default cfg.steps) with a checkpoint, as if interrupted there; a later call
    with `resume=True` continues exactly where it stopped (same windows, same RNG, same optimizer state).
    Under torchrun every process calls this; only rank 0 writes or prints.
    """
    d = ddp.setup()
    out = Path(out)
    until = cfg.steps if until is None else until
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // d.local_world))
    need(cfg.seq_len <= model_cfg.max_seq_len,
         f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    need(data.vocab_size <= model_cfg.vocab_size,
         f"{data.path}: tokens use a vocabulary of {data.vocab_size}, the model has {model_cfg.vocab_size}")
    train_tok, val_tok = data.split(cfg.val_fraction, cfg.seq_len)
    global_batch = cfg.batch_size * d.world

    model = Decoder(model_cfg)
    model.reset_parameters(cfg.seed)  # its own generator: every rank starts from the same weights
    torch.manual_seed(cfg.seed + d.rank)  # dropout / drop-path draws, per rank
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    sampler = WindowSampler(train_tok, cfg.seq_len, cfg.seed)
    step, losses, evals = 0, [], []
    if resume:
        if d.main:
            checkpoint.recover(out)
        ddp.barrier(d)
        state, weights = checkpoint.load(out)
        need(state["model_config"] == model_cfg.to_dict(), f"--resume: {out} holds a different model config")
        saved_batch = state["world"] * state["train_config"]["batch_size"]
        need(saved_batch == global_batch, f"--resume: {out} was trained with a global batch of {saved_batch} "
             f"windows, this run has {global_batch}")
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        sampler.set_state(state["sampler"])
        if len(state["torch_rng"]) == d.world:
            torch.set_rng_state(state["torch_rng"][d.rank])
        step, losses, evals = state["step"], list(state["losses"]), [tuple(e) for e in state["evals"]]
        need(step <= until, f"--resume: {out} is already at step {step}, past --steps {until}")
    elif d.main:
        need(not checkpoint.is_complete(out),
             f"-o {out}: already holds a training checkpoint; pass --resume to continue it or choose another -o")
    # the only buffers are RoPE tables, identical everywhere: no per-forward buffer sync
    net: nn.Module = nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False) if d.world > 1 else model

    val_offsets = eval_offsets(len(val_tok), cfg.seq_len, cfg.eval_steps * global_batch)
    entropy = unigram_entropy(val_tok, model_cfg.vocab_size)
    tokens_per_step = global_batch * cfg.grad_accum * cfg.seq_len
    start_step, t0 = step, time.perf_counter()
    fit_at = max(cfg.warmup, 5) if cfg.time_budget_s is not None and step == 0 else None
    t_first = t0  # when this run's first step ended: the fit leaves out its one-off start-up cost
    bar = _progress_bar(progress and d.main, step, until)
    val_loss = evals[-1][1] if evals else float("nan")

    def snapshot() -> None:
        rng_states = ddp.gather(d, torch.get_rng_state())
        if d.main:
            checkpoint.save(out, model, {
                "step": step, "tokens": step * tokens_per_step, "losses": losses, "evals": evals,
                "val_loss": val_loss, "unigram_entropy": entropy, "sampler": sampler.state(),
                "torch_rng": rng_states, "world": d.world, "optimizer": optimizer.state_dict(),
                "train_config": cfg.to_dict(), "model_config": model_cfg.to_dict()})
        ddp.barrier(d)

    while step < until:
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = 0.0
        for micro in range(cfg.grad_accum):
            x, y = (torch.from_numpy(a) for a in sampler.draw(global_batch, d.rank, d.world))
            last = micro == cfg.grad_accum - 1
            with net.no_sync() if d.world > 1 and not last else contextlib.nullcontext():
                logits, _ = net(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / cfg.grad_accum
                loss.backward()
            step_loss += loss.item()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(ddp.all_sum(d, [step_loss])[0] / d.world)
        if step == start_step + 1:
            t_first = time.perf_counter()
        if step == fit_at and step < until:
            cfg = _fit_to_budget(cfg, d, step, t0, t_first)
            until = min(until, cfg.steps)
            bar.total = until
        if not math.isfinite(losses[-1]):
            raise EdgeError(f"training diverged at step {step} (loss {losses[-1]}); lower --lr or raise --warmup")
        out_of_time = ddp.any_rank(d, d.main and cfg.time_budget_s is not None
                                   and time.perf_counter() - t0 > cfg.time_budget_s)
        if step % cfg.eval_every == 0 or step == until or out_of_time:
            val_loss = evaluate(model, val_tok, val_offsets, cfg.seq_len, cfg.batch_size, d)
            evals.append((step, val_loss))
        done = (step - start_step) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
        bar.update(1)
        val_text = f" val {val_loss:.3f}" if math.isfinite(val_loss) else ""
        bar.set_postfix_str(f"loss {losses[-1]:.3f}{val_text} lr {lr:.2e} {done:,.0f} tok/s")
        if step % cfg.save_every == 0 or step == until or out_of_time:
            snapshot()
        if out_of_time:
            break
    bar.close()
    if not evals or evals[-1][0] != step:  # a resume at the final step: still report a validation loss
        val_loss = evaluate(model, val_tok, val_offsets, cfg.seq_len, cfg.batch_size, d)
        evals.append((step, val_loss))
    tail = losses[-max(1, min(10, len(losses))):] if losses else [float("nan")]
    return TrainResult(out=out, steps=step, tokens=step * tokens_per_step, train_loss=float(np.mean(tail)),
                       val_loss=val_loss, unigram_entropy=entropy, wall_s=time.perf_counter() - t0,
                       n_params=sum(p.numel() for p in model.parameters()), losses=list(losses),
                       evals=list(evals))


def _fit_to_budget(cfg: TrainConfig, d: ddp.Dist, step: int, t0: float, t_first: float) -> TrainConfig:
    """cfg with `steps` cut to what fits in the time budget at the speed of steps 2..`step` (rank 0 decides)."""
    now = time.perf_counter()
    per_step = (now - t_first) / max(step - 1, 1)
    left = cfg.time_budget_s - (now - t0)
    fitted = ddp.broadcast(d, step + int(0.92 * left / per_step))  # 8% kept for evaluations and saves
    return dataclasses.replace(cfg, steps=max(step, min(cfg.steps, fitted)))


@torch.no_grad()
def evaluate(model: nn.Module, val_tok: np.ndarray, offsets: np.ndarray, seq_len: int, batch_size: int,
             d: ddp.Dist) -> float:
    """Mean next-token loss (nats) over the fixed held-out windows; ranks split them and sum."""
    was_training = model.training
    model.eval()
    mine = offsets[d.rank :: d.world]
    total, count = 0.0, 0
    for i in range(0, len(mine), batch_size):
        x, y = (torch.from_numpy(a) for a in windows(val_tok, mine[i : i + batch_size], seq_len))
        logits, _ = model(x)
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    total, count = ddp.all_sum(d, [total, float(count)])
    return total / count


def _progress_bar(enabled: bool, step: int, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=step, disable=not enabled, unit="step", dynamic_ncols=True, leave=False)
