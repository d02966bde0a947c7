"""`QuantizeOptions`: what `edgellm quantize` was asked for, checked flag by flag, and the plan it makes.

Which weight gets what (first match wins):
  1. `--keep PATTERN`            fp32 (fnmatch on the module path, e.g. "layers.0.*", or the initializer name)
  2. the lm_head                 `--lm-head` int8 (group 32) | int4 (`--group-size`, default 32) | fp32;
                                 default: the linears' bits (the CLI's --bits 4: int8, profiles.py);
                                 `--lm-head-int8-rows F` (int8 head, --bits 4): only the fraction F of its
                                 vocabulary rows that matter most int8, the rest int4 (headsplit.py)
  3. `--int8-layers 0,-1`        every linear of those layers int8 (group 32; with `--bits 4`)
     `--int8-fraction F`         (with `--bits 4`) the linears that matter most, about a fraction F of the
                                 linears' weights, int8: chosen by measured sensitivity (mixed.py)
  4. every other linear          `--bits`, `--group-size`, `--symmetric/--asymmetric`, `--method`
  5. the token embedding         `--embeddings` int8 (per row) | fp32
Then `--group PATTERN=N` sets the block size of the quantized matmul weights PATTERN matches (first match),
whatever rule chose their bits: e.g. "layers.*.mlp.gate_up=64" halves those weights' scale bytes.
Module paths are the state-dict ones of design.md; a tied lm_head (stored as `embed.weight`) answers to
"lm_head" and the embedding table to "embed". `--method awq`: AWQ's scale migration (awq.py), then the
`mse` clip search weighted by per-input-channel activation scales, both from calibrate.py. `--method gptq`:
GPTQ's error-compensating rounding against each linear's calibration Hessian (gptq.py; `--act-order`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from edgellm.runtime.errors import need

from .headsplit import HI, LO, part_name
from .methods import QuantSpec
from .plan import SCALES_DTYPES, Chooser, Format, QuantPlan, WeightSite, by_pattern, site_matches
from .profiles import GRID_FIELDS
from .schemes import Scheme

BITS = (4, 8)
GROUPS = (0, 16, 32, 64, 128, 256)      # 0 = one scale per output channel; 16..256: onnxruntime's kernel
Method = Literal["rtn", "mse", "awq", "gptq", "grid"]   # grid: set by --block-min auto (grids.py), not a flag
Embeddings = Literal["int8", "fp32"]
LmHead = Literal["int8", "int4", "fp32"]
METHODS: tuple[Method, ...] = get_args(Method)[:-1]
EMBEDDINGS: tuple[Embeddings, ...] = get_args(Embeddings)
LM_HEADS: tuple[LmHead, ...] = get_args(LmHead)
INT8_GROUP = 32    # the --bits 8 default block: llama.cpp Q8_0 layout (g32, fp16 scale = 8.5 bits/weight)
# QuantizeOptions.block_min: 4-bit linears with a float offset per block (schemes.Scheme.offsets, llama.cpp Q4_1's
# layout: +1 bit per weight (+0.5 with fp16 scales), an AveragePool per activation, an 8-bit MatMulNBits (a kept
# grid's: a float MatMul) and an Add per linear: SmolLM2-135M decodes ~0.8x as fast); "on" for the CLI's balanced
# --bits 4 profile on float weights (profiles.py). `keep_grids` (the CLI's `--block-min auto`): where every 4-bit
# linear already lies on a llama.cpp grid (a model converted from a GGUF), each is kept exactly (grids.py), offsets
# where its grid has them, and `on_grids` replaces the fields the user did not set
BLOCK_MINS = ("on", "off")
# QuantizeOptions.kv_dtype: None, the export's cache as it is ("float32": and it must be an fp32 one); "auto", the
# CLI's default: float16 where the export can hold one (kv_cache.py: half the bytes, quality within noise, decode
# -2 to -6 % at a few hundred tokens of context and +21 % at 1800);
# int8 is a flag: on SmolLM2-135M-Instruct int4 it decodes plain text 17-30 % faster but greedy speculation on
# grounded tasks 13-30 % slower (onnxruntime's int8 attention runs several rows in its reference kernel), and costs
# int8 weights KL 0.0055 -> 0.0096 (kv_int8.py)
KV_DTYPES = ("auto", "float32", "float16", "int8")
ACCURACY_LEVELS = (0, 1, 4)             # fp32, fp32 (same kernels on CPU), int8 activations
TIED_NAMES = ("embed.weight", "lm_head.weight")


@dataclass(frozen=True)
class QuantizeOptions:
    bits: int = 4
    group_size: int | None = None       # None: 32 for int4, INT8_GROUP for int8
    symmetric: bool = True
    format: Format = "fast"
    method: Method = "rtn"
    embeddings: Embeddings = "int8"
    lm_head: LmHead | None = None          # None: int4 for --bits 4, int8 for --bits 8 (see `head`)
    keep: tuple[str, ...] = ()
    int8_layers: tuple[int, ...] = ()
    accuracy_level: int = 4
    calibration_tokens: int = 512
    seed: int = 0
    act_order: bool = False
    int8_fraction: float = 0.0
    fp16_scales: bool = True            # scales rounded to and (fast format) stored as float16
    groups: tuple[tuple[str, int], ...] = ()  # `--group PATTERN=N`: (pattern, block size) of matmul weights
    head_int8_rows: float = 1.0         # `--lm-head-int8-rows`: the int8 head's rows kept int8 (headsplit.py)
    calibration_text: str | None = None  # `--calibration-text`: calibrate on this file instead of sampled text
    kv_dtype: str | None = None         # `--kv-dtype` (kv_cache.py); None: the export's cache as it is
    scales_dtype: str = "auto"          # `--scales-dtype` (SCALES_DTYPES)
    block_min: str = "off"              # `--block-min` on / off (BLOCK_MINS)
    keep_grids: bool = False            # `--block-min auto` (grids.py)
    # the fields `keep_grids` replaces when it keeps the linears' own grids: (field, value), those the user did not
    # set (profiles.ON_GRIDS)
    on_grids: tuple[tuple[str, Any], ...] = ()
    # what `--block-min auto` found (grids.py; method "grid"): (weight, bits, block size, offsets) of every linear
    # kept exactly on its own grid
    kept_grids: tuple[tuple[str, int, int, bool], ...] = ()

    def validate(self, n_layers: int | None = None) -> None:
        """EdgeError naming the flag; with `n_layers`, also the layer indices."""
        need(self.bits in BITS, f"--bits: expected 4 or 8, got {self.bits!r}")
        need(self.group_size is None or self.group_size in GROUPS,
             f"--group-size: expected one of 32, 64, 128 (or 16, 256; 0 = per output channel), got {self.group_size!r}")
        need(self.format in ("fast", "portable"), f"--format: expected fast or portable, got {self.format!r}")
        need(self.method in METHODS, f"--method: expected one of {', '.join(METHODS)}, got {self.method!r}")
        need(self.embeddings in EMBEDDINGS,
             f"--embeddings: expected int8 or fp32, got {self.embeddings!r} (int4 embeddings are not supported: "
             "a gathered row is used as is, with no matmul to average its rounding error away)")
        need(self.lm_head is None or self.lm_head in LM_HEADS,
             f"--lm-head: expected one of {', '.join(LM_HEADS)}, got {self.lm_head!r}")
        need(self.accuracy_level in ACCURACY_LEVELS,
             f"--accuracy-level: expected 0, 1 or 4, got {self.accuracy_level!r}")
        need(self.format == "fast" or self.accuracy_level == 4,
             "--accuracy-level: only for --format fast (a portable graph's level is onnxruntime's session "
             "config session.qdq_matmulnbits_accuracy_level)")
        need(isinstance(self.calibration_tokens, int) and 16 <= self.calibration_tokens <= 1_000_000,
             f"--calibration-tokens: expected an integer in 16..1000000, got {self.calibration_tokens!r}")
        need(not self.int8_layers or self.bits == 4,
             "--int8-layers: only with --bits 4 (every layer is int8 already)")
        need(isinstance(self.int8_fraction, int | float) and 0.0 <= self.int8_fraction <= 1.0,
             f"--int8-fraction: expected a number in 0..1, got {self.int8_fraction!r}")
        need(self.int8_fraction == 0.0 or self.bits == 4, "--int8-fraction: only with --bits 4")
        need(not self.act_order or self.method == "gptq", "--act-order: only with --method gptq")
        need(isinstance(self.head_int8_rows, int | float) and 0.0 < self.head_int8_rows <= 1.0,
             f"--lm-head-int8-rows: expected a fraction in (0, 1], got {self.head_int8_rows!r}")
        need(not self.split_head or (self.bits == 4 and self.head == "int8"),
             "--lm-head-int8-rows: only with --bits 4 and an int8 lm_head (the other rows are int4)")
        need(not self.split_head or self.format == "fast",
             "--lm-head-int8-rows: only with --format fast (a portable int4 part could not be gathered by "
             "a tied lookup)")
        bad = [k for k, _ in self.on_grids if k not in GRID_FIELDS]
        need(not bad, f"on_grids: expected fields among {', '.join(sorted(GRID_FIELDS))}, got {bad}")
        need(self.scales_dtype in SCALES_DTYPES,
             f"--scales-dtype: expected {', '.join(SCALES_DTYPES)}, got {self.scales_dtype!r}")
        need(self.block_min in BLOCK_MINS, f"--block-min: expected {', '.join(BLOCK_MINS)}, got {self.block_min!r}")
        if self.block_min == "on":
            need(self.bits == 4 and self.format == "fast" and self.symmetric,
                 "--block-min on: only with --bits 4 and --format fast, without --asymmetric (the offset "
                 "replaces its zero point)")
            need(self.method in ("rtn", "mse", "awq", "grid"),
                 f"--block-min on: each block's min..max (rtn), or llama.cpp's k-quant search of step and offset "
                 f"(mse; awq adds its scale migration); expected --method rtn, mse or awq, got {self.method}")
            need(self.group != 0, "--block-min on: needs blocks (--group-size 16..256, not 0)")
        need(self.kv_dtype is None or self.kv_dtype in KV_DTYPES,
             f"--kv-dtype: expected {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.calibration_text is not None:
            need(Path(self.calibration_text).is_file(),
                 f"--calibration-text: {self.calibration_text}: not a file (expected a UTF-8 text file)")
            need(self.calibrated or self.kv_dtype == "int8",
                 "--calibration-text: nothing here calibrates (it is for --method awq/gptq, --int8-fraction, the "
                 "head split of --lm-head-int8-rows and --kv-dtype int8)")
        for pattern in self.keep:
            need(isinstance(pattern, str) and pattern != "", "--keep: expected a non-empty pattern")
        for rule in self.groups:
            need(isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str) and rule[0] != "",
                 f"--group: expected PATTERN=N, got {rule!r}")
            need(rule[1] in GROUPS, f"--group {rule[0]}={rule[1]}: expected a block size of "
                                    f"{', '.join(map(str, GROUPS[1:]))} or 0 (per output channel)")
        if n_layers is not None:
            bad = [i for i in self.int8_layers if not -n_layers <= i < n_layers]
            need(not bad, f"--int8-layers: layer(s) {bad} out of range for a {n_layers}-layer model "
                          f"(0..{n_layers - 1}, or -1 for the last)")

    @property
    def group(self) -> int:
        if self.group_size is not None:
            return self.group_size
        return 32 if self.bits == 4 else INT8_GROUP

    def _spec(self, scheme: Scheme) -> QuantSpec:
        # awq is the mse search, made activation-aware by the plan's act_scales; "grid" (grids.py) is only for
        # the linears it found on a grid (`kept_grids`): any other weight is rounded to nearest
        return QuantSpec(scheme, {"awq": "mse", "grid": "rtn"}.get(self.method, self.method))

    def linear_spec(self) -> QuantSpec:
        offsets = self.block_min == "on"
        return self._spec(Scheme(self.bits, self.group, self.symmetric and not offsets, offsets))

    def int8_spec(self) -> QuantSpec:
        """Per-channel int8: the embedding table of its own (per row)."""
        return self._spec(Scheme(8, 0, self.symmetric))

    def promoted_spec(self) -> QuantSpec:
        """int8 for the lm_head, `--int8-layers` and `--int8-fraction` weights: --bits 8's group (its default
        with --bits 4). With --bits 4 and awq/mse they are rounded to nearest: the clip search buys nothing at
        8 bits (SmolLM2, AWQ + --int8-fraction 0.13: KL 0.331 with clip-searched int8, 0.321 with RTN)."""
        scheme = Scheme(8, self.group if self.bits == 8 else INT8_GROUP, self.symmetric)
        if self.bits == 4 and self.method in ("awq", "mse"):
            return QuantSpec(scheme, "rtn")
        return self._spec(scheme)

    @property
    def head(self) -> str:
        """The lm_head's precision. By default the linears': the lm_head is the largest single matrix (a fifth
        of stories110M's weights, a quarter of Qwen2.5-0.5B's) and decode reads all of it every token, so an
        int8 head in an int4 model costs ~10 % of int4 decode speed (docs/benchmarks.md); `--lm-head int8`
        buys back about half of the int4 model's KL for that (docs/quantization.md)."""
        if self.lm_head is not None:
            return self.lm_head
        return "int4" if self.bits == 4 else "int8"

    @property
    def split_head(self) -> bool:
        """Whether the lm_head is split by rows (headsplit.py): `--lm-head-int8-rows` below 1."""
        return self.head_int8_rows < 1.0

    def lm_head_spec(self) -> QuantSpec | None:
        if self.head == "fp32":
            return None
        if self.head == "int8":
            return self.promoted_spec()
        return self.int4_head_spec()

    def int4_head_spec(self) -> QuantSpec:
        """`--lm-head int4`."""
        return self._spec(Scheme(4, self.group or 32, self.symmetric))

    def low_rows_spec(self) -> QuantSpec:
        """The int4 rows of a split head: rounded to nearest, the rounding their importance was measured with
        (headsplit.py), with no activation scales of their own for awq's weighted search."""
        return QuantSpec(self.int4_head_spec().scheme,
                         "rtn" if self.method in ("awq", "mse", "grid") else self.method)

    def chooser(self, n_layers: int, promoted: frozenset[str] = frozenset()) -> Chooser:
        """`promoted`: module paths or initializer names that get int8 (`--int8-fraction`'s choice)."""
        rules: list[tuple[str, QuantSpec | None]] = [(p, None) for p in self.keep]
        # a split head's parts answer to "lm_head" (--keep, --group) and to their own names
        rules += [(f"lm_head.{HI}.weight", self.promoted_spec()), (f"lm_head.{LO}.weight", self.low_rows_spec()),
                  ("lm_head", self.lm_head_spec())]
        rules += [(f"layers.{i % n_layers}.*", self.promoted_spec()) for i in self.int8_layers]
        rules += [(name, self.promoted_spec()) for name in sorted(promoted)]
        rules += [(name, QuantSpec(Scheme(bits, block, not offsets, offsets), "grid"))
                  for name, bits, block, offsets in self.kept_grids]
        embed = self.int8_spec() if self.embeddings == "int8" else None
        inner = by_pattern(self.linear_spec(), rules, embed=embed, embed_pattern="embed")

        def choose(site: WeightSite) -> QuantSpec | None:
            site = logical_site(site)
            spec = inner(site)
            if spec is None or site.op == "Gather":  # a row lookup's table: per row, or the tied lm_head's
                return spec
            rule = next(((pattern, n) for pattern, n in self.groups if site_matches(site, pattern)), None)
            if rule is not None:
                need(rule[1] != 0 or not spec.scheme.offsets, f"--group {rule[0]}=0: {site.module or site.name} "
                                                               "has block minima (--block-min), which need blocks")
                spec = replace(spec, scheme=replace(spec.scheme, block_size=rule[1]))
            if spec.scheme.offsets and site.shape[1] % spec.scheme.block_size:
                # block offsets are one AveragePool over whole blocks (rewrite.py): a K that is no multiple of the
                # block (a toy model's 176) gets the symmetric blocks MatMulNBits pads
                spec = replace(spec, scheme=replace(spec.scheme, symmetric=True, offsets=False))
            return spec
        return choose

    def plan(self, n_layers: int, act_scales: Mapping[str, np.ndarray] | None = None,
             hessians: Mapping[str, np.ndarray] | None = None, promoted: frozenset[str] = frozenset(),
             tied: frozenset[str] = frozenset()) -> QuantPlan:
        return QuantPlan(self.chooser(n_layers, promoted), self.format, self.accuracy_level, dict(act_scales or {}),
                         dict(hessians or {}), self.act_order, tight_channel_blocks=True,
                         fp16_scales=self.fp16_scales, fp16_stored=SCALES_DTYPES[self.scales_dtype], tied=tied)

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration (activation scales, Hessians)."""
        # block minima's k-quant search (mse) weighs each input channel by its activations: without them, SmolLM2 off
        # its grid reached KL 0.292 even with the whole table int8, with them 0.139 with 30 % of its rows
        return (self.method in ("awq", "gptq") or (self.method == "mse" and self.block_min == "on")
                or self.int8_fraction > 0 or self.split_head)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["group_size"], d["lm_head"] = self.group, self.head
        d["keep"], d["int8_layers"] = list(self.keep), list(self.int8_layers)
        d["groups"] = [list(rule) for rule in self.groups]
        d["kept_grids"] = [list(rule) for rule in self.kept_grids]
        d["on_grids"] = {k: v for k, v in self.on_grids}
        return d


def logical_site(site: WeightSite) -> WeightSite:
    """The site as the user names it (what `--keep` patterns see): a matmul reading the embedding table (a
    tied lm_head) is module "lm_head", weight "lm_head.weight"; a row lookup in it is "embed"."""
    if site.name in TIED_NAMES:
        module = "embed" if site.op == "Gather" else "lm_head"
        return WeightSite(f"{module}.weight", site.op, site.node, module, site.shape)
    part = next((p for t in TIED_NAMES for p in (HI, LO) if site.name == part_name(t, p)), None)
    if part is not None:          # a part of a row-split head (headsplit.py); a lookup in it is "embed"
        module = "embed" if site.op == "Gather" else "lm_head"
        name = site.name if site.op == "Gather" else f"lm_head.{part}.weight"
        return WeightSite(name, site.op, site.node, module, site.shape)
    return site


def logical_name(site: WeightSite) -> str:
    """The weight's name in reports and the manifest (the state-dict name; `lm_head.weight` when tied)."""
    return logical_site(site).name


def unmatched_keeps(options: QuantizeOptions, sites: list[WeightSite]) -> list[str]:
    """`--keep` and `--group` patterns (as flags: "--keep P", "--group P=N") that matched no weight (almost always
    a typo)."""
    flags = [(f"--keep {p!r}", p) for p in options.keep] + [(f"--group {p}={n}", p) for p, n in options.groups]
    return [flag for flag, p in flags if not any(site_matches(logical_site(s), p) for s in sites)]
