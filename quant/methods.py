"""How the per-block scale (and zero point) is chosen; `schemes` then rounds the weight onto that grid.

  rtn  round-to-nearest over the full block range: absmax (symmetric) or min..max (asymmetric).
       Never clips, so |w - dequantize(w)| <= scale / 2 for every element.
  mse  per-block grid search over clipping ratios r (the range [lo, hi] shrunk to [r*lo, r*hi]),
       keeping, per block, the r with the smallest squared error. r = 1 is RTN, so the result is never
       worse than RTN block by block. Clipping a few outliers buys a finer step for all other weights.
       With `act_scale` [K] (mean |activation| per input channel from calibration) the error is weighted:
       minimise ||(W - Wq) * act_scale||^2, i.e. the output error E|x (W - Wq)^T|^2 for uncorrelated
       inputs. This is the clip search of AWQ without its scale migration: migrating scales would need
       an op before every MatMul, and this rewrite only touches weights.
All of it is vectorised over blocks; rows are processed in chunks so peak memory stays ~100 MB even for
a [151936, 896] lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.runtime.errors import need

from .schemes import (
    QuantizedWeight,
    Scheme,
    block_range,
    codes_for,
    dequantize_blocks,
    params_from_range,
    quantize,
    row_chunks,
    to_blocks,
)

METHODS = ("rtn", "mse")
# gptq (gptq.py) needs a Hessian, which the plan holds; grid (gridfit.py) keeps a weight's own grid exactly
SPEC_METHODS = METHODS + ("gptq", "grid")
CLIP_RATIOS = np.linspace(0.5, 1.0, 21)      # step 0.025; 1.0 (= RTN) must stay in the grid


@dataclass(frozen=True)
class QuantSpec:
    """What to do with one weight: the integer scheme and how its scales are chosen."""

    scheme: Scheme
    method: str = "rtn"

    def __post_init__(self) -> None:
        need(self.method in SPEC_METHODS,
             f"quantization method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")

    @property
    def label(self) -> str:
        return f"{self.scheme.label}-{self.method}"


def block_weights(act_scale: np.ndarray | None, k: int, block_len: int) -> np.ndarray | None:
    """Per-element error weights act_scale^2 [K] -> [n_blocks, block_len] (zero on the K padding)."""
    if act_scale is None:
        return None
    a = np.asarray(act_scale, np.float32).reshape(-1)
    need(a.shape[0] == k and bool(np.all(np.isfinite(a))) and bool(np.all(a >= 0)),
         f"act_scale must be {k} finite non-negative values (one per input channel), got shape {a.shape}")
    return to_blocks((a * a)[None, :], block_len)[0]


def search_params(wb: np.ndarray, scheme: Scheme, weights: np.ndarray | None = None,
                  ratios: np.ndarray = CLIP_RATIOS) -> tuple[np.ndarray, np.ndarray]:
    """Per-block clip-ratio search on blocks [N, nb, bl] -> (scale float32, zero point uint8) [N, nb]."""
    lo, hi = block_range(wb, scheme.symmetric)
    best_scale, best_zp = params_from_range(lo, hi, scheme)
    best_err = np.full(lo.shape, np.inf, np.float32)
    for r in ratios:
        scale, zp = params_from_range(lo * np.float32(r), hi * np.float32(r), scheme)
        err = (wb - dequantize_blocks(codes_for(wb, scale, zp, scheme), scale, zp)) ** 2
        if weights is not None:
            err *= weights
        err = err.sum(axis=-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_zp = np.where(better, zp, best_zp)
    return best_scale.astype(np.float32), best_zp.astype(np.uint8)


def quantize_weight(w: np.ndarray, scheme: Scheme, method: str = "rtn",
                    act_scale: np.ndarray | None = None) -> QuantizedWeight:
    """Quantize w [N, K] (canonical layout) with the chosen scale method; act_scale [K] only affects `mse`."""
    need(method in METHODS, f"quantization method must be one of {', '.join(METHODS)}, got {method!r}")
    w = np.asarray(w, np.float32)
    need(w.ndim == 2 and bool(np.all(np.isfinite(w))), f"weight must be a finite 2-D array, got shape {w.shape}")
    if method == "rtn":
        return quantize(w, scheme)
    n, k = w.shape
    bl = scheme.block_len(k)
    weights = block_weights(act_scale, k, bl)
    params = [search_params(to_blocks(w[sl], bl), scheme, weights) for sl in row_chunks(n, k)]
    scales, zps = (np.concatenate(p) for p in zip(*params, strict=True))
    return quantize(w, scheme, scales, zps)


def weighted_sq_error(w: np.ndarray, w_hat: np.ndarray, act_scale: np.ndarray | None = None) -> float:
    """sum(((W - Wq) * act_scale)^2) over [N, K] (plain squared error when act_scale is None)."""
    d = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    if act_scale is not None:
        d = d * np.asarray(act_scale, np.float64)[None, :]
    return float(np.sum(d * d))
