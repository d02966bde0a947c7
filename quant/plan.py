"""Quantization plans: which weight gets which `QuantSpec` (or stays fp32), in which on-disk format.

A `QuantPlan` picks a spec per weight from a `WeightSite` (initializer name, torch module path, op, shape),
so callers can mix precisions (`by_pattern`). It also owns the per-weight work the rewrite shares between
graphs: `quantize` memoises by (name, spec, content), so the prefill and decode variants of a graph - and a
tied table read by two graphs - are quantized once and packed into byte-identical initializers (which a
content-keyed data file then stores once).

GPTQ: a `gptq` spec whose weight has a calibration Hessian in `hessians` is rounded by gptq.py (error
compensation, group scales by the diag(H)-weighted clip search); without one (a Gather, a weight the
calibration did not see) it falls back to the activation-weighted `mse` search.

Activation-aware ("awq" in reports): a `mse` spec whose weight has calibration scales in `act_scales`
minimises the activation-weighted error ||(W - Wq) * mean|x| ||^2 instead of the plain one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Literal, get_args

import numpy as np

from edgellm.runtime.errors import need

from .gptq import gptq_quantize
from .gridfit import fit
from .methods import QuantSpec, quantize_weight, snap_offsets
from .packing import NBitsArrays, expand_per_channel, to_matmulnbits
from .schemes import QuantError, QuantizedWeight, fp16_exact, quant_error, with_fp16_scales

Format = Literal["fast", "portable"]  # MatMulNBits (onnxruntime) | DequantizeLinear + MatMul (any runtime)
FORMATS: tuple[Format, ...] = get_args(Format)
# Measured (x86 dev VM, ORT 1.31, [1,1,768] x [768,2048], 1 thread, median us, levels 0/1/4): int4 g32
# 138/136/44, int4 g128 141/139/36, int8 g32 ~2700/2683/63, int8 g256 1794/2020/51; fp32 MatMul 275.
# Level 4 (int8 activations per block) is 3-4x faster for int4 and ~40x for int8 (x86 has no fp32-activation
# int8 kernel), at a relative output error of ~1e-2 instead of ~1e-7. ORT-genai also defaults to 4 on CPU.
DEFAULT_ACCURACY_LEVEL = 4
NBITS_BLOCKS = (256, 128, 64, 32, 16)   # what onnxruntime's CPU MatMulNBits kernel takes
# `--scales-dtype` (QuantizeOptions.scales_dtype): how the fast format stores MatMulNBits' scales (their values
# are fp16-rounded either way: `fp16_scales`). float16 halves their bytes, but onnxruntime keeps the float32 copy it folds the Cast
# into for the session's life, next to the packed weights; float32 scales the runtime maps and releases once
# packed (placement.Placement.packed_files). "auto": float32 for 4-bit weights (peak RSS: SmolLM2-135M int4 -15 MB,
# Qwen2.5-0.5B int4 -58 MB, for +0.5 bit per weight on disk; with block minima their offsets too, 6 bits per weight
# on disk: SmolLM2 103.5 MB, 25 MB less RSS once open than fp16's 5 bits, Q4_1's), float16 for 8-bit ones (Q8_0's
# 8.5 bits per weight)
# (kinds: "int4", "int8", and "int4-min" for 4-bit weights with block offsets, whose offsets follow their scales)
SCALES_DTYPES = {"auto": ("int8",), "float16": ("int4", "int8", "int4-min"),
                 "float32": ()}  # -> QuantPlan.fp16_stored


@dataclass(frozen=True)
class WeightSite:
    """One float initializer a plan may quantize."""

    name: str                  # initializer name (torch's exporter names folded transposes `val_N`)
    op: str                    # "MatMul" | "Gemm" | "Gather"
    node: str                  # name of the first node using it
    module: str                # torch module path, e.g. "layers.0.attn.qkv" ("" if unknown)
    shape: tuple[int, int]     # canonical [N, K] for matmuls, [V, D] for Gather


Chooser = Callable[[WeightSite], "QuantSpec | None"]


def channel_block(k: int) -> int:
    """MatMulNBits block for a per-channel weight of K inputs: the fewest bytes (codes incl. K padding +
    a 4-byte scale per block), ties to the larger block. K = 288: 32 (324 B/row) where 256 would pad to
    512 codes (520 B/row); any K that is a multiple of 256: 256."""
    def row_bytes(bs: int) -> int:
        nb = -(-k // bs)
        return nb * (bs + 4)
    return min(NBITS_BLOCKS, key=row_bytes)


@dataclass(frozen=True)
class QuantPlan:
    choose: Chooser
    format: str = "fast"
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL              # MatMulNBits attribute (fast format)
    act_scales: Mapping[str, np.ndarray] = field(default_factory=dict)   # initializer name -> [K], for mse
    hessians: Mapping[str, np.ndarray] = field(default_factory=dict)     # initializer name -> X^T X [K, K]
    act_order: bool = False                                              # GPTQ column order (gptq.py)
    # per-channel weights in MatMulNBits: False = blocks of 256 (`expand_per_channel`'s default), True =
    # `channel_block(K)`, which never pads K by more than a block of 16..256 chosen for the fewest bytes
    tight_channel_blocks: bool = False
    # scales rounded to float16 (codes re-rounded on that grid); the fast format then stores them as fp16
    # and a Cast feeds MatMulNBits (onnxruntime folds it when the session is created: same kernels)
    fp16_scales: bool = False
    # the MatMulNBits bit widths whose fp16-rounded scales the fast format stores fp16 (+ the Cast); the others
    # are stored float32, as MatMulNBits reads them: onnxruntime keeps a scale initializer for the session's life
    # next to its packed copy, and a float32 one the runtime maps and releases (placement.Placement.packed_files)
    # where the Cast's folded float32 copy stays resident (SCALES_DTYPES: "auto" unless given)
    fp16_stored: tuple[str, ...] = SCALES_DTYPES["auto"]
    # tables the lm_head also reads (a tied model's embed.weight): their row lookups are quant/tied.py's, which
    # gathers the lm_head's quantized codes, not a second table of rewrite.py's own
    tied: frozenset[str] = frozenset()
    memo: dict = field(default_factory=dict, compare=False, repr=False)   # see `quantize`

    def __post_init__(self) -> None:
        need(self.format in FORMATS, f"quantization format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        need(self.accuracy_level in (0, 1, 2, 3, 4), f"accuracy_level must be 0..4, got {self.accuracy_level}")

    def half_scales(self, arr: NBitsArrays, values: np.ndarray) -> bool:
        """Whether the fast format stores these MatMulNBits scales (or block offsets) of `arr` as float16, a Cast
        feeding the kernel."""
        kind = f"int{arr.bits}" + ("-min" if arr.offsets is not None else "")
        return self.fp16_scales and kind in self.fp16_stored and fp16_exact(values)

    def act_scale(self, site: WeightSite) -> np.ndarray | None:
        """Calibration scales [K] for a matmul weight (a Gather's error does not depend on activations)."""
        return None if site.op == "Gather" else self.act_scales.get(site.name)

    def quantize(self, site: WeightSite, w: np.ndarray, spec: QuantSpec) -> tuple[QuantizedWeight, QuantError]:
        """Quantize w [N, K] (canonical) once per (name, spec, act-awareness, content); later calls with the
        same weight return the very same arrays."""
        act = self.act_scale(site)
        h = self.hessian(site, spec)
        digest = hashlib.sha256(memoryview(np.ascontiguousarray(w)).cast("B")).hexdigest()
        key = (site.name, spec, act is not None, h is not None, w.shape, digest)
        hit = self.memo.get(key)
        if hit is None:
            if spec.method == "grid":      # its own grid, step (and offset) as the source stored them
                kept = fit(np.asarray(w, np.float32), spec.scheme)
                need(kept is not None, f"{site.module or site.name}: some rows lie off the grid its sampled rows "
                                       f"lie on ({spec.scheme.label}); quantize with --block-min off")
                qw = kept
            elif h is not None:
                qw = gptq_quantize(w, h, spec.scheme, self.act_order)
            else:
                qw = quantize_weight(w, spec.scheme, "mse" if spec.method == "gptq" else spec.method, act)
            if self.fp16_scales and spec.method != "grid":
                qw = with_fp16_scales(w, qw, recode=h is None)
            if qw.offsets is not None and spec.method != "grid" and self.format == "fast":
                qw = snap_offsets(w, qw, act)       # the 8-bit offset term's grid (rewrite.py)
            hit = self.memo[key] = (qw, quant_error(w, qw))
        return hit

    def hessian(self, site: WeightSite, spec: QuantSpec) -> np.ndarray | None:
        """The calibration Hessian [K, K] a `gptq` spec rounds a matmul weight against, if there is one."""
        if spec.method != "gptq" or site.op == "Gather":
            return None
        return self.hessians.get(site.name)

    def label(self, site: WeightSite, spec: QuantSpec) -> str:
        """The report's scheme label; an act-weighted `mse` search reads "awq"; gptq without a Hessian "mse"."""
        if spec.method == "gptq":
            return spec.label if self.hessian(site, spec) is not None else f"{spec.scheme.label}-mse"
        if spec.method == "mse" and self.act_scale(site) is not None:
            return f"{spec.scheme.label}-awq"
        return spec.label

    def nbits(self, qw: QuantizedWeight) -> NBitsArrays:
        """MatMulNBits packing of a quantized weight, per-channel blocks chosen by `tight_channel_blocks`;
        with it, a single block wider than K also shrinks to the smallest kernel block >= K (same codes and
        scales, less padding: K = 64 at group 128 stores 64 codes per row, not 128)."""
        s = qw.scheme
        if s.block_size == 0 and self.tight_channel_blocks:
            qw = expand_per_channel(qw, channel_block(qw.k))
        elif self.tight_channel_blocks and qw.scales.shape[1] == 1:
            narrow = min(b for b in NBITS_BLOCKS if b >= min(qw.k, s.block_size))
            if narrow < s.block_size:
                qw = QuantizedWeight(replace(s, block_size=narrow), qw.k, qw.codes[:, :narrow],
                                     qw.scales, qw.zero_points, qw.offsets)
        return to_matmulnbits(qw)


def by_pattern(default: QuantSpec | None, rules: Sequence[tuple[str, QuantSpec | None]] = (),
               embed: QuantSpec | None = None, embed_pattern: str = "*embed*") -> Chooser:
    """First rule whose fnmatch pattern matches the module path or initializer name wins; otherwise
    matmuls get `default`, and Gathers matching `embed_pattern` get `embed` (other Gathers, e.g. a folded
    RoPE table, stay fp32). E.g. rules=[("lm_head", int8_spec), ("layers.0.*", None)]."""
    def choose(site: WeightSite) -> QuantSpec | None:
        for pattern, spec in rules:
            if site_matches(site, pattern):
                return spec
        if site.op == "Gather":
            return embed if site_matches(site, embed_pattern) else None
        return default
    return choose


def site_matches(site: WeightSite, pattern: str) -> bool:
    """fnmatch (case-sensitive) on the module path or the initializer name."""
    return fnmatchcase(site.module, pattern) or fnmatchcase(site.name, pattern)


@dataclass(frozen=True)
class WeightReport:
    name: str
    module: str
    op: str
    shape: tuple[int, int]
    scheme: str                # QuantPlan.label, or "fp32" when kept
    bytes_before: int
    bytes_after: int
    max_abs_err: float
    rel_rms_err: float
    shared_with: str = ""      # a table stored once for two uses: the other use (bytes_after is 0 here)
