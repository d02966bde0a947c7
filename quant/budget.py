"""`--kl-budget X`: the smallest export whose measured mean KL against the fp32 export stays within X.

The variants form a ladder from small to large (`LADDER`, sizes measured on SmolLM2-135M, docs/benchmarks.md);
each is quantized with the user's other flags (method, format, symmetry, --keep, ...) on ONE calibration (the
block-minima rungs with their own method, the k-quant search; fast format and symmetric codes only), and
measured by quantize's own check (KL over CHECK_TOKENS positions the fp32 export samples, record.py).
The first variant within the budget is kept: the ladder is ordered by size, so it is the smallest of them.
No variant within the budget: a one-line error naming the best KL reached, and no output is left behind.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.manifest import read_manifest

from .calibrate import calibrate
from .export_dir import QuantizeResult, quantize_export
from .options import QuantizeOptions

# (label, overrides of QuantizeOptions), smallest first. Past the int4 default, block minima with llama.cpp's k-quant
# search buy more KL per byte than int8 linears or blocks of 16 do (SmolLM2-135M moved off its grid, harness KL: g32
# minima + int8 table + 15 % int8 0.088 at 105.3 MB where g16 + int8 table + 16 % int8 gave 0.108 at 105.4 and AWQ g32
# + 20 % int8 0.133 at 101.9), but they decode ~20 % slower than symmetric blocks on onnxruntime 1.32's x86 kernels
# (three more nodes per linear): the log says so when such a rung is kept. Between an int4 and an int8 table, only
# the table rows that carry the probability int8 (headsplit.py: SmolLM2 0.227 at 81.4 MB vs 0.205 at 91.1)
MINIMA = dict(bits=4, group_size=32, lm_head="int8", head_int8_rows=1.0, block_min="on", method="mse")
LADDER: tuple[tuple[str, dict], ...] = (
    ("int4-g64, int4 table", dict(bits=4, group_size=64, lm_head="int4", int8_fraction=0.0, head_int8_rows=1.0)),
    ("int4-g32, int4 table", dict(bits=4, group_size=32, lm_head="int4", int8_fraction=0.0, head_int8_rows=1.0)),
    ("int4-g32, table 30% int8 rows",
     dict(bits=4, group_size=32, lm_head="int8", int8_fraction=0.0, head_int8_rows=0.3)),
    ("int4-g32, int8 table", dict(bits=4, group_size=32, lm_head="int8", int8_fraction=0.0, head_int8_rows=1.0)),
    ("int4-g32 with block minima, int8 table", dict(MINIMA, int8_fraction=0.0)),
    ("int4-g32 with block minima, int8 table, 15% int8", dict(MINIMA, int8_fraction=0.15)),
    ("int4-g32 with block minima, int8 table, 35% int8", dict(MINIMA, int8_fraction=0.35)),
    ("int8", dict(bits=8, group_size=None, lm_head=None, int8_fraction=0.0, act_order=False, head_int8_rows=1.0)),
)


@dataclass(frozen=True)
class Tried:
    label: str
    bytes: int
    mean_kl: float


def variants(options: QuantizeOptions) -> list[tuple[str, QuantizeOptions]]:
    """The ladder with the user's other flags; --act-order only where the method is gptq."""
    out = []
    for label, change in LADDER:
        if change.get("block_min") == "on" and (options.format != "fast" or not options.symmetric):
            continue  # block minima are MatMulNBits' symmetric codes plus an offset term (fast format only)
        if change.get("head_int8_rows", 1.0) < 1.0 and options.format != "fast":
            continue  # a table split into int8 and int4 rows is gathered by fast-format ops only
        v = dataclasses.replace(options, on_grids=(), **change)   # each rung's settings are its label's, grids or not
        if v.method != "gptq":
            v = dataclasses.replace(v, act_order=False)
        if not v.calibrated:    # a rung that reads no calibration (rtn, no split) has no use for the text
            v = dataclasses.replace(v, calibration_text=None)
        out.append((label, v))
    return out


def smallest_within(src: Path, out: Path, options: QuantizeOptions, budget: float, *, progress: bool = True,
                    log: Callable[[str], None] = print) -> tuple[QuantizeResult, list[Tried]]:
    """Quantize the ladder's variants into `out` in order until one's measured KL is <= budget."""
    need(isinstance(budget, float) and math.isfinite(budget) and budget > 0,
         f"--kl-budget: expected a positive number, got {budget!r}")
    ladder = variants(options)
    for _, v in ladder:
        v.validate()
    existed = Path(out).exists()
    manifest = read_manifest(Path(src))
    calib = calibrate(Path(src), manifest, options.calibration_tokens, options.seed, hessians=True,
                      text=options.calibration_text)
    tried: list[Tried] = []
    for label, v in ladder:
        result = quantize_export(src, out, v, check=True, progress=progress, log=lambda _: None, calibration=calib)
        assert result.check is not None
        tried.append(Tried(label, result.files_after, result.check.mean_kl))
        log(f"--kl-budget {budget:g}: {label}: {result.files_after / 1e6:.2f} MB, mean KL {result.check.mean_kl:.4g}")
        if result.check.mean_kl <= budget:
            if v.block_min == "on":
                log(f"--kl-budget {budget:g}: kept {label}; note: block minima decode ~20 % slower than "
                    "symmetric blocks on x86 onnxruntime")
            return result, tried
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
    best = min(tried, key=lambda t: t.mean_kl)
    raise EdgeError(f"--kl-budget {budget:g}: no variant is within it; the best measured mean KL is "
                    f"{best.mean_kl:.4g} ({best.label}); raise the budget or keep weights fp32 (--keep)")
