"""Whether this machine computes an export's verification rows bit for bit as its decode steps, remembered.

`speculative.rows_exact_here` measures it (~10 decode steps against verifications of the same tokens: 0.16 /
0.2 / 0.7 s at the stories110M / SmolLM2-135M / Qwen2.5-0.5B int4 shapes on the dev VM), and `edgellm run`
needs the answer before every greedy run with `--speculative auto`. It depends only on the export's graphs,
onnxruntime's kernels for this CPU and the thread count, so it is measured once per (export, onnxruntime
version, CPU, threads) and kept in `$XDG_CACHE_HOME/edgellm/rows.json` (~/.cache when unset). A known "no"
also lets a greedy run open the lone-row stack from the start: where the kernels compute a lone row and
several differently (4-bit MatMulNBits on AVX2-only x86 and on cortex-a72, 8-bit on cortex-a76) the stack's
spare attention row cannot make speculation exact, and it costs a decode step 0-15 % (stories110M int4 on an
AVX2 EPYC, 2026-11-28). Every greedy run of one export on one machine then decodes through the same stack.

The file is a cache: one that cannot be read (another version, not JSON, not writable) is measured past with a
note, never an error. Format "edgellm-rows" version 1: {"format", "version", "verdicts": {key: {"exact",
"diff", "export", "measured"}}}, at most KEEP entries (the oldest go first).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from .errors import EdgeError
from .fileio import atomic_write_text, sha256_file

FORMAT = "edgellm-rows"
VERSION = 1
KEEP = 64
# /proc/cpuinfo fields that name the kernels onnxruntime picks: x86 model and ISA flags; arm64 core and features
_CPU_FIELDS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")


@dataclass(frozen=True)
class Verdict:
    exact: bool     # every verification row equals the decode step of its token, bit for bit
    diff: float     # max |difference| of the logits measured (0.0 when exact)
    remembered: bool = False  # read from the file rather than measured by this process


def memo_path() -> Path:
    """$XDG_CACHE_HOME/edgellm/rows.json (~/.cache/edgellm/rows.json when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgellm" / "rows.json"


def cpu_identity() -> str:
    """The first processor's identifying /proc/cpuinfo lines (platform.processor() where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    seen: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in _CPU_FIELDS and name not in seen:
            seen[name] = " ".join(sorted(value.split())) if name in ("flags", "Features") else value.strip()
    return f"{platform.machine()} " + "; ".join(f"{k}={v}" for k, v in sorted(seen.items()))


def memo_key(directory: Path, threads: int | None) -> str:
    """The export (its manifest, which holds every file's sha256), onnxruntime, the CPU and the thread count."""
    parts = (sha256_file(Path(directory) / "manifest.json"), ort.__version__, cpu_identity(),
             str(threads or os.cpu_count()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read(path: Path, note: bool = True) -> dict[str, dict]:
    """The file's well-formed verdicts; {} when it is missing, and (with a note) when it cannot be used."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        if not (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("version") == VERSION
                and isinstance(doc.get("verdicts"), dict)):
            raise ValueError(f"expected format {FORMAT!r} version {VERSION}")
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        if note:
            print(f"[{path}: ignored ({err}); measuring again]", file=sys.stderr)
        return {}
    return {k: v for k, v in doc["verdicts"].items() if isinstance(v, dict) and isinstance(v.get("exact"), bool)
            and isinstance(v.get("diff"), int | float) and isinstance(v.get("measured"), str)}


def recall(key: str, path: Path | None = None) -> Verdict | None:
    """The verdict kept for `key`, or None."""
    entry = _read(path or memo_path()).get(key)
    return None if entry is None else Verdict(entry["exact"], float(entry["diff"]), remembered=True)


def remember(key: str, verdict: Verdict, export: Path, path: Path | None = None) -> None:
    """Keep `verdict` for `key` (best effort: a read-only home only costs the next run a measurement)."""
    path = path or memo_path()
    verdicts = _read(path, note=False)  # recall() said so already
    verdicts[key] = {"exact": verdict.exact, "diff": verdict.diff, "export": str(Path(export).resolve()),
                     "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    kept = dict(sorted(verdicts.items(), key=lambda kv: kv[1]["measured"])[-KEEP:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": FORMAT, "version": VERSION, "verdicts": kept}, indent=1))
    except (OSError, EdgeError):  # a cache: not being able to keep it is no reason to stop a run
        pass
