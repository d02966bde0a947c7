"""Timings of one generation and the process's peak memory.

Definitions (the same as the performance anchors in docs/benchmarks.md):
- time to first token (TTFT): from the start of `generate` to the first new token picked — tokenizing,
  the whole prompt forward and the first sampling step;
- prefill tok/s = prompt tokens / TTFT;
- decode tok/s = decode steps / time from the first to the last token picked (steps = tokens picked - 1,
  an EOS included);
- runtime overhead = the share of the decode time spent outside onnxruntime's Run calls (Python, cache
  writes, sampling, detokenizing).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB. On Linux the kernel's high-water mark of this
    process image (VmHWM in /proc/self/status), not ru_maxrss: a process started by fork + exec inherits its
    parent's ru_maxrss (a child of a 500 MB process reported 513 MB for its own 13), so `edgellm run` started
    from a training script or a notebook would report its launcher's peak. Elsewhere ru_maxrss (KiB; bytes on
    macOS)."""
    hwm = _proc_mb("/proc/self/status", b"VmHWM:")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def huge_pages_mb() -> float:
    """MiB of this process's anonymous memory in transparent huge pages now (AnonHugePages of
    /proc/self/smaps_rollup, Linux >= 4.14); 0.0 where the kernel does not say. Where the packed weights
    live: `edgellm run` and `edgellm bench` ask glibc for huge pages (edgellm/cli/hugepages.py)."""
    huge = _proc_mb("/proc/self/smaps_rollup", b"AnonHugePages:")
    return 0.0 if huge is None else huge


def _proc_mb(path: str, field: bytes) -> float | None:
    """The value of `field` ("Name:  1234 kB") in a /proc file, in MiB; None without the file or the field."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float                 # time to first token
    prefill_tok_s: float          # prompt_tokens / ttft_s
    decode_s: float               # first to last new token
    decode_tok_s: float           # decode steps / decode_s; 0 with fewer than 2 tokens picked
    decode_run_s: float           # of decode_s, inside onnxruntime Run calls
    overhead_pct: float           # 100 * (decode_s - decode_run_s) / decode_s

    def to_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def make_timings(prompt_tokens: int, new_tokens: int, steps: int, ttft_s: float, decode_s: float,
                 decode_run_s: float) -> Timings:
    """`steps`: decode forwards between the first and the last token picked (an EOS counts as picked)."""
    decode_tok_s = steps / decode_s if steps and decode_s > 0 else 0.0
    overhead = 100.0 * (decode_s - decode_run_s) / decode_s if steps and decode_s > 0 else 0.0
    prefill = prompt_tokens / ttft_s if prompt_tokens and ttft_s > 0 else 0.0
    return Timings(prompt_tokens, new_tokens, ttft_s, prefill, decode_s if steps else 0.0, decode_tok_s,
                   decode_run_s if steps else 0.0, max(overhead, 0.0))


def format_stats(t: Timings, peak_mb: float) -> str:
    """The one stats line `edgellm run` prints after the text."""
    return (f"prompt {t.prompt_tokens} tok | TTFT {t.ttft_s * 1000:.1f} ms | prefill {t.prefill_tok_s:.1f} tok/s"
            f" | decode {t.decode_tok_s:.1f} tok/s ({t.new_tokens} tok) | peak RSS {peak_mb:.0f} MB")
