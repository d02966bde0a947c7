"""Speed and memory measurements behind `edgellm bench`, with the anchors' workload definitions.

Workload: a prompt of fixed pseudo-random token ids (seed 1234, so no tokenizer is needed), greedy
decoding of `new_tokens` tokens with EOS ignored and no detokenizing (ids out, as the anchors timed it), one warm-up run then `runs` timed runs, medians with
(min-max). Prefill tok/s = prompt tokens / time to first token; decode tok/s = (new tokens - 1) / time from
the first to the last new token (see `edgellm.runtime.stats`).

The machine may be shared: every timed run measures the share of all CPUs used by other processes
(/proc/stat busy time minus this process's own CPU time; Linux only) and is repeated, up to RETRIES
times, while that share exceeds `max_foreign_pct`. Rows report the highest share among their kept runs.

The PyTorch side runs edgellm's own `Decoder` with an argmax loop over the static cache (the runtime's
`KVCache` rule), in a child process so each system's peak RSS is its own.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

PROMPT_SEED = 1234
RETRIES = 5


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks over all CPUs since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class LoadMeter:
    """Percent of the machine's CPU time used by other processes between `__init__` and `foreign()`."""

    def __init__(self) -> None:
        self.ticks = _cpu_ticks()
        t = os.times()
        self.own = t.user + t.system

    def foreign(self) -> float | None:
        now = _cpu_ticks()
        if self.ticks is None or now is None or now[1] <= self.ticks[1]:
            return None
        t = os.times()
        own = (t.user + t.system - self.own) * os.sysconf("SC_CLK_TCK")
        busy, total = now[0] - self.ticks[0], now[1] - self.ticks[1]
        return max(0.0, 100.0 * (busy - own) / total)


def timed_runs(once: Callable[[], tuple], runs: int, max_foreign_pct: float) -> tuple[list[tuple], float | None]:
    """One warm-up call of `once`, then `runs` kept calls (each retried while the foreign load is above
    `max_foreign_pct`, at most RETRIES times); (their results, the highest foreign load kept)."""
    once()
    kept, worst = [], None
    for _ in range(runs):
        for attempt in range(RETRIES + 1):
            meter = LoadMeter()
            result = once()
            load = meter.foreign()
            if load is None or load <= max_foreign_pct or attempt == RETRIES:
                break
        kept.append(result)
        worst = load if worst is None or (load is not None and load > worst) else worst
    return kept, worst


def bench_prompt(length: int, vocab_size: int) -> list[int]:
    return np.random.default_rng(PROMPT_SEED).integers(0, vocab_size, size=length).tolist()


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(self.median)} ({fmt.format(self.low)}-{fmt.format(self.high)})"


@dataclass(frozen=True)
class Row:
    system: str           # "edgellm" | "pytorch"
    context: int          # prompt tokens
    prefill_tok_s: Spread
    decode_tok_s: Spread
    ttft_ms: Spread
    overhead_pct: Spread | None   # edgellm only: decode time outside onnxruntime Run calls
    peak_rss_mb: float
    foreign_load_pct: float | None  # the most CPU other processes used during a kept run
    token_ids: list[int]  # of the last run, to check both systems agree

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("token_ids")
        out["first_tokens"] = self.token_ids[:8]
        return out


def _row(system: str, context: int, runs: list[tuple], rss: float, load: float | None) -> Row:
    """`runs`: (prefill tok/s, decode tok/s, ttft s, overhead % | None, token ids) per kept run."""
    prefill, decode, ttft, overhead, ids = zip(*runs, strict=True)
    return Row(system, context, Spread.of(list(prefill)), Spread.of(list(decode)),
               Spread.of([t * 1000 for t in ttft]),
               Spread.of(list(overhead)) if overhead[0] is not None else None, rss, load, list(ids[-1]))


def bench_edgellm(gen, contexts: list[int], new_tokens: int, runs: int, max_foreign_pct: float = 3.0) -> list[Row]:
    """`gen`: an opened edgellm.runtime.Generator."""
    from edgellm.runtime.sampling import SamplingParams, StopParams
    from edgellm.runtime.stats import peak_rss_mb

    greedy, stop = SamplingParams(temperature=0.0), StopParams(max_new_tokens=new_tokens, seed=0)
    rows = []
    for context in contexts:
        prompt = bench_prompt(context, gen.manifest.vocab_size)

        def once(prompt: list[int] = prompt) -> tuple:
            r = gen.complete(prompt, greedy, stop, ignore_eos=True, text=False)  # ids in, ids out
            t = r.timings
            return t.prefill_tok_s, t.decode_tok_s, t.ttft_s, t.overhead_pct, r.token_ids

        kept, load = timed_runs(once, runs, max_foreign_pct)
        rows.append(_row("edgellm", context, kept, peak_rss_mb(), load))
    return rows


def torch_generate(model, prompt: list[int], new_tokens: int, max_seq: int) -> tuple[list[int], float, float]:
    """Greedy decode with `model` over a static cache; (new ids, ttft seconds, first-to-last seconds)."""
    import torch

    from edgellm.runtime.graphio import cache_rows
    from edgellm.runtime.kvcache import KVCache

    cfg = model.cfg
    cache = KVCache(cfg.n_layers, cfg.n_kv_heads, max_seq, cfg.hd, rows=cache_rows(cfg.to_dict(), max_seq))
    past = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in zip(cache.keys, cache.values, strict=True)]
    ids: list[int] = []
    start = time.perf_counter()
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        while True:
            logits, new = model(tokens, past=past, past_len=torch.from_numpy(cache.past_len()))
            for i, (k, v) in enumerate(new):
                cache.write(i, k.numpy(), v.numpy(), tokens.shape[1])
            cache.advance(tokens.shape[1])
            ids.append(int(logits[0, -1].argmax()))
            if len(ids) == 1:
                first = time.perf_counter()
            if len(ids) == new_tokens:
                break
            tokens = torch.tensor([[ids[-1]]])
    return ids, first - start, time.perf_counter() - first


def bench_torch_inprocess(checkpoint: Path, contexts: list[int], new_tokens: int, runs: int, threads: int,
                          max_seq: int, max_foreign_pct: float = 3.0) -> list[Row]:
    import torch

    from edgellm.loaders import load_checkpoint
    from edgellm.runtime.stats import peak_rss_mb

    torch.set_num_threads(threads)
    model = load_checkpoint(checkpoint).model.eval()
    model.set_context_len(max_seq)
    rows = []
    for context in contexts:
        prompt = bench_prompt(context, model.cfg.vocab_size)

        def once(prompt: list[int] = prompt, context: int = context) -> tuple:
            ids, ttft, decode_s = torch_generate(model, prompt, new_tokens, max_seq)
            return context / ttft, (new_tokens - 1) / decode_s, ttft, None, ids

        kept, load = timed_runs(once, runs, max_foreign_pct)
        rows.append(_row("pytorch", context, kept, peak_rss_mb(), load))
    return rows


def bench_torch(checkpoint: Path, contexts: list[int], new_tokens: int, runs: int, threads: int,
                max_seq: int, max_foreign_pct: float = 3.0) -> list[Row]:
    """`bench_torch_inprocess` in a child process (its own peak RSS, torch never loaded here)."""
    spec = json.dumps({"checkpoint": str(checkpoint), "contexts": contexts, "new_tokens": new_tokens,
                       "runs": runs, "threads": threads, "max_seq": max_seq, "max_foreign_pct": max_foreign_pct})
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli.bench_measure", spec], capture_output=True, text=True)
    if proc.returncode != 0:
        from edgellm.runtime.errors import EdgeError

        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgeError(f"--vs-torch {checkpoint}: the PyTorch run failed ({last})")
    return [_row_from_json(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def _row_from_json(d: dict) -> Row:
    spread = {k: Spread(**d[k]) if d[k] is not None else None
              for k in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "overhead_pct")}
    return Row(d["system"], d["context"], peak_rss_mb=d["peak_rss_mb"], foreign_load_pct=d["foreign_load_pct"],
               token_ids=d["token_ids"], **spread)


def format_table(rows: list[Row]) -> list[str]:
    lines = [f"{'system':<8} {'ctx':>5}  {'prefill tok/s':<24} {'decode tok/s':<24} {'TTFT ms':<22} "
             f"{'overhead %':<18} {'peak RSS MB':>11} {'other load %':>12}"]
    for r in rows:
        over = r.overhead_pct.text() if r.overhead_pct is not None else "-"
        load = f"{r.foreign_load_pct:.1f}" if r.foreign_load_pct is not None else "-"
        lines.append(f"{r.system:<8} {r.context:>5}  {r.prefill_tok_s.text():<24} {r.decode_tok_s.text():<24} "
                     f"{r.ttft_ms.text():<22} {over:<18} {r.peak_rss_mb:>11.0f} {load:>12}")
    return lines


def ratios(rows: list[Row], base: str = "pytorch") -> dict[int, dict[str, float]]:
    """Per context: edgellm / base medians of prefill and decode tok/s, and whether the tokens agree."""
    out = {}
    for r in rows:
        if r.system != "edgellm":
            continue
        other = next((o for o in rows if o.system == base and o.context == r.context), None)
        if other is not None:
            out[r.context] = {"prefill": r.prefill_tok_s.median / other.prefill_tok_s.median,
                              "decode": r.decode_tok_s.median / other.decode_tok_s.median,
                              "same_tokens": r.token_ids == other.token_ids}
    return out


if __name__ == "__main__":  # the child process of bench_torch
    args = json.loads(sys.argv[1])
    result = bench_torch_inprocess(Path(args["checkpoint"]), args["contexts"], args["new_tokens"], args["runs"],
                                   args["threads"], args["max_seq"], args["max_foreign_pct"])
    print(json.dumps([{**asdict(r)} for r in result]))
