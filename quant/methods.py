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
       Blocks with offsets (Scheme.offsets, Q4_1's layout) search their grid as llama.cpp's k-quants do
       (`search_offsets`): codes from the block's min..max at 15 + r steps, r = -1 .. 1, then the (weighted)
       least-squares step and offset for those codes; RTN's min..max grid is a candidate, so never worse.
All of it is vectorised over blocks; rows are processed in chunks so peak memory stays ~100 MB even for
a [151936, 896] lm_head.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from edgellm.runtime.errors import need

from .schemes import (
    OFFSET_TERM,
    QuantizedWeight,
    Scheme,
    block_range,
    codes_for,
    dequantize_blocks,
    fp16_exact,
    offset_params,
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


def block_error(wb: np.ndarray, scheme: Scheme, weights: np.ndarray | None, scale: np.ndarray, zp: np.ndarray,
                offset: np.ndarray | None = None) -> np.ndarray:
    """Per block [N, nb]: sum(weights (w - w rounded onto the grid of scale, zp (and offset))^2) of blocks wb."""
    err = (wb - dequantize_blocks(codes_for(wb, scale, zp, scheme, offset), scale, zp, offset)) ** 2
    return (err if weights is None else err * weights).sum(axis=-1)


def ls_step(wb: np.ndarray, wts: np.ndarray, q: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Per block [N, nb], float32: the step s minimising sum(wts (s q - wb)^2) for signed codes q [N, nb, bl] (wb
    measured from the grid's centre), `fallback` where every code is 0."""
    den = (wts * q * q).sum(-1)
    return np.where(den > 0, (wts * q * wb).sum(-1) / np.where(den > 0, den, 1), fallback).astype(np.float32)


# a search's best codes fitted again, as often: the step (and offset) that minimise the squared error for the codes the
# best candidate rounds to differ from the candidate's (block offsets, the Q4_K_M-level flags on SmolLM2 off-grid:
# weighted error -1.8 %, KL 0.0902 -> 0.0859; five refits 0.0862; symmetric blocks, the int4 / int8 defaults there:
# 0.192 -> 0.184, 0.0056 -> 0.0053)
REFITS = 2
THREADS = max(1, min(4, os.cpu_count() or 1))   # quantize_weight's row chunks searched at once


def search_params(wb: np.ndarray, scheme: Scheme, weights: np.ndarray | None = None,
                  ratios: np.ndarray = CLIP_RATIOS) -> tuple[np.ndarray, np.ndarray]:
    """Per-block clip-ratio search on blocks [N, nb, bl] -> (scale float32, zero point uint8) [N, nb]."""
    lo, hi = block_range(wb, scheme.symmetric)
    best_scale, best_zp = params_from_range(lo, hi, scheme)
    best_err = np.full(lo.shape, np.inf, np.float32)
    for r in ratios:
        scale, zp = params_from_range(lo * np.float32(r), hi * np.float32(r), scheme)
        err = block_error(wb, scheme, weights, scale, zp)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_zp = np.where(better, zp, best_zp)
    if scheme.symmetric:  # the best's own codes, their least-squares step (as the offsets' search refits)
        wts = np.ones(wb.shape[-1], np.float32) if weights is None else weights
        for _ in range(REFITS):
            q = codes_for(wb, best_scale, best_zp, scheme).astype(np.float32) - np.float32(scheme.mid)
            scale = ls_step(wb, wts, q, best_scale)
            err = block_error(wb, scheme, weights, scale, best_zp)
            better = (err < best_err) & (scale != 0)
            best_err, best_scale = np.where(better, err, best_err), np.where(better, scale, best_scale)
    return best_scale.astype(np.float32), best_zp.astype(np.uint8)


# llama.cpp's make_qkx2_quants steps: the codes of min..max at (15 + r) / (max - min) per unit, r = -1, -0.9, .. 1
OFFSET_STEPS = np.linspace(-1.0, 1.0, 21)


def search_offsets(wb: np.ndarray, scheme: Scheme, weights: np.ndarray | None = None,
                   steps: np.ndarray = OFFSET_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Step and offset float32 [N, nb] (fp16-exact) of 4-bit blocks with offsets [N, nb, bl]: per block, for
    each candidate code assignment L (the block's min..max at 15 + r steps, clipped to 0..15), the step d and
    offset m minimising sum(weights (d L + m - w)^2) (normal equations), rounded to fp16 and scored with the
    codes they round the block to; the best per block, RTN's (hi - lo) / 15 and lo among them; then REFITS times
    the same fit for the best's own codes, kept where it scores better."""
    lo, hi = wb.min(axis=-1), wb.max(axis=-1)
    wts = np.broadcast_to(np.ones(wb.shape[-1]) if weights is None else weights, wb.shape).astype(np.float64)
    x = wb.astype(np.float64)
    span = np.where(hi > lo, hi - lo, 1.0).astype(np.float64)[..., None]
    sw, swx = wts.sum(-1), (wts * x).sum(-1)
    zp = np.zeros(lo.shape, np.uint8)

    def fitted(q: np.ndarray, d0: np.ndarray, m0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weighted error, d, m): the step and offset minimising sum(weights (d q + m - w)^2) for codes q (normal
        equations; d0, m0 where q is degenerate), rounded to fp16, the block rounded onto their grid."""
        wq = wts * q                                     # (wts q) q and (wts q) x: the same products, once
        sl, sll, slx = wq.sum(-1), (wq * q).sum(-1), (wq * x).sum(-1)
        det = sw * sll - sl * sl
        ok = det > 1e-30 * np.maximum(sw * sll, 1e-30)
        safe = np.where(ok, det, 1.0)
        d = np.where(ok, (sw * slx - sl * swx) / safe, d0).astype(np.float16).astype(np.float32)
        m = np.where(ok, (sll * swx - sl * slx) / safe, m0).astype(np.float16).astype(np.float32)
        return block_error(wb, scheme, weights, d, zp, m), d, m

    best_d, best_m = offset_params(wb)                      # min..max (Q4_1's rule) is a candidate
    best_err = block_error(wb, scheme, weights, best_d, zp, best_m)
    above = x - lo[..., None]
    for i in range(len(steps) + REFITS):  # then the best's own codes, fitted again (fp16 rounding moved a few)
        if i < len(steps):
            q = np.clip(np.rint(above * ((15 + steps[i]) / span)), 0, 15)
            err, d16, m16 = fitted(q, (hi - lo) / 15, lo)
        else:
            err, d16, m16 = fitted(codes_for(wb, best_d, zp, scheme, best_m).astype(np.float64), best_d, best_m)
        better = (err < best_err) & (d16 > 0)
        best_err = np.where(better, err, best_err)
        best_d, best_m = np.where(better, d16, best_d), np.where(better, m16, best_m)
    return best_d.astype(np.float32), best_m.astype(np.float32)


def snap_offsets(w: np.ndarray, qw: QuantizedWeight, act_scale: np.ndarray | None = None) -> QuantizedWeight:
    """qw (4-bit with offsets) with each block's centre m + 8 d moved onto the 8-bit grid of the offset term
    (schemes.OFFSET_TERM: a step per 16 blocks, their largest |centre| / 127), so the graph computes the weight
    reported. Per block, the grid level below or above the centre, each with the step kept or refit by weighted
    least squares for that centre (fp16 where the step was): the least weighted error. A group's largest centre
    keeps its level, so the term's rounding finds the same grid again."""
    s, n, k = qw.scheme, *w.shape
    bl, nb = s.block_len(k), s.n_blocks(k)
    weights = block_weights(act_scale, k, bl)
    wts = np.ones(bl, np.float32) if weights is None else weights
    steps, minima = qw.scales.copy(), qw.offsets.copy()
    half = fp16_exact(steps)
    per = OFFSET_TERM.block_size
    for sl in row_chunks(n, k):
        wb, d = to_blocks(np.asarray(w[sl], np.float32), bl), qw.scales[sl]
        centre = qw.offsets[sl] + np.float32(8) * d                                    # [rows, nb]
        padded = np.pad(np.abs(centre), ((0, 0), (0, -nb % per)))
        g = padded.reshape(len(centre), -1, per).max(-1).repeat(per, axis=1)[:, :nb] / np.float32(127)
        level = np.where(g > 0, centre / np.where(g > 0, g, 1), 0.0)
        top = np.abs(np.rint(level)) >= 127                                            # the group's largest
        zp = np.zeros(d.shape, np.uint8)
        best_err = np.full(d.shape, np.inf)
        best_d, best_m = d, minima[sl]
        for lv in (np.floor(level), np.ceil(level)):
            c = (np.where(top, np.rint(level), np.clip(lv, -127, 127)) * g).astype(np.float32)
            q = np.clip(np.rint((wb - c[..., None]) / np.where(d > 0, d, 1)[..., None]), -8, 7)
            refit = ls_step(wb - c[..., None], wts, q, d)
            if half:
                refit = refit.astype(np.float16).astype(np.float32)
            for step in (d, np.where(refit > 0, refit, d)):
                m = (c - np.float32(8) * step).astype(np.float32)
                err = block_error(wb, s, weights, step, zp, m)
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best_d, best_m = np.where(better, step, best_d), np.where(better, m, best_m)
        steps[sl], minima[sl] = best_d, best_m
    return quantize(np.asarray(w, np.float32), s, steps, offsets=minima)


def search_zero_points(wb: np.ndarray, scheme: Scheme, weights: np.ndarray | None,
                       scale: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric blocks [N, nb, bl] (an integer zero point): the k-quant search of `search_offsets` with the
    offset on the integer grid — per candidate step (min..max at qmax + r steps) the zero point rounds -min / step,
    then the (weighted) least-squares step for those codes — against the given (scale, zp) [N, nb]; the better
    per block."""
    wts = np.ones(wb.shape[-1], np.float32) if weights is None else weights
    lo, hi = block_range(wb, False)
    span = np.where(hi > lo, hi - lo, 1.0)
    best_err, best_s, best_z = block_error(wb, scheme, weights, scale, zp), scale, zp
    for r in OFFSET_STEPS:
        d = (span / (scheme.qmax + r)).astype(np.float32)
        z = np.clip(np.rint(-lo / d), 0, scheme.qmax).astype(np.uint8)
        c = codes_for(wb, d, z, scheme).astype(np.float32) - z[..., None]
        s = ls_step(wb, wts, c, d)
        s = np.where(s > 0, s, d)
        err = block_error(wb, scheme, weights, s, z)
        better = err < best_err
        best_err, best_s, best_z = np.where(better, err, best_err), np.where(better, s, best_s), np.where(better, z, best_z)
    return best_s.astype(np.float32), best_z.astype(np.uint8)


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

    def search(sl: slice) -> tuple[np.ndarray, np.ndarray]:
        wb = to_blocks(w[sl], bl)
        if scheme.offsets:
            return search_offsets(wb, scheme, weights)
        found = search_params(wb, scheme, weights)
        return found if scheme.symmetric else search_zero_points(wb, scheme, weights, *found)

    # rows are searched independently and numpy's elementwise work runs on one core: a thread per core over row
    # chunks, the same results (Qwen2.5-0.5B --profile balanced quantized in 688 s on 2 cores before)
    chunks = row_chunks(n, k, THREADS)
    if len(chunks) == 1:
        params = [search(chunks[0])]
    else:
        with ThreadPoolExecutor(min(THREADS, len(chunks))) as pool:
            params = list(pool.map(search, chunks))
    found, other = (np.concatenate(p) for p in zip(*params, strict=True))
    return quantize(w, scheme, found, offsets=other) if scheme.offsets else quantize(w, scheme, found, other)


def weighted_sq_error(w: np.ndarray, w_hat: np.ndarray, act_scale: np.ndarray | None = None) -> float:
    """sum(((W - Wq) * act_scale)^2) over [N, K] (plain squared error when act_scale is None)."""
    d = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    if act_scale is not None:
        d = d * np.asarray(act_scale, np.float64)[None, :]
    return float(np.sum(d * d))
