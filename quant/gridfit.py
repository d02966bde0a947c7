"""A weight's own grid, recovered: the exact step (and offset) of every block of weights that were dequantized from
llama.cpp blocks, so they can be stored again without a second rounding (`--block-min auto`, quant/grids.py).

What the GGUF block types dequantize to, per block of the kernel's block size B (32, or 16):
  Q4_0           (q - 8) d,        q in 0..15                      symmetric 4-bit: codes -8..7, step d (fp16)
  Q4_1, Q4_K     m + q d,          q in 0..15 (Q4_K: 32-weight sub-blocks with d = d0 * sc, m = -dmin * mn: the
                                   codes need not span 0..15, and neither d nor m need be fp16)
                                                                   4-bit with a float offset
  Q5_0, Q8_0     (q - 16) d, q d   symmetric, |codes| <= 16 / 127   8-bit, step d (fp16)
  Q6_K           (q - 32) d0 sc    per 16 weights (sc an int8)      8-bit at B = 16, step d0 * sc (not fp16)
Recovery, per block (vectorised over blocks):
  symmetric: every value is an integer multiple of the step s, and the smallest nonzero |w| is j s for a small
             j; s = that / j for the first j = 1, 2, ... under which every w / s lies within TOL of an integer
             in the code range (a float block has no such j: its values are not multiples of anything).
  affine:    every w - min is an integer multiple of s, min..max at most 15 steps: s = (max - min) / c for the
             first c = 15, 14, ... that fits (a block with fewer than 15 steps between its extremes fits at a
             multiple of its c: the same values on a finer grid, still exact).
Step and offset are taken rounded to fp16 where that is as exact (Q4_0/Q4_1/Q5_0/Q8_0: bit for bit the GGUF's d
and m), float32 otherwise (the fast format stores a weight's scales fp16 only when they survive it: plan.py).
"""

from __future__ import annotations

import numpy as np

from .schemes import QuantizedWeight, Scheme, codes_for, row_chunks, to_blocks

TOL = 1e-3  # of a step: float32 arithmetic of a dequantizer is ~1e-7 off; a float weight ~0.25 on average
LEVELS = 16  # 4-bit codes
# fp16 step and offset are taken where they reproduce a block as well as the float32 ones, to an ulp of its
# largest value: a GGUF's own d and m (a 1e-3-of-a-step tolerance would take fp16 values a few 1e-4 off Q4_K's)
ULP = 2.0 ** -23


def _fits(wb: np.ndarray, s: np.ndarray, lo: int, hi: int, offset: np.ndarray | None = None) -> np.ndarray:
    """Per block [M]: every value of wb [M, B] within TOL of a step of s [M] (from offset), codes in lo..hi (a
    value past them is at least a step off its clipped code)."""
    return (s != 0) & (_error(wb, s, lo, hi, offset) <= TOL * np.abs(s))


def symmetric_steps(wb: np.ndarray, bits: int) -> np.ndarray | None:
    """Steps s [M] (sign chosen so the codes lie in -2^(b-1)..2^(b-1)-1) of blocks wb [M, B] that are all
    integer multiples of one; None when some block is not."""
    top = (1 << (bits - 1)) - 1                       # 7 | 127: codes -top-1..top
    a = np.abs(wb)
    amax = a.max(-1)
    s0 = np.where(a > 0, a, np.inf).min(-1)           # the smallest nonzero magnitude: j steps
    steps = np.zeros(len(wb), np.float32)
    todo = amax > 0                                   # all-zero blocks: step 0, codes at the zero point
    # s >= amax / (top + 1): j <= s0 (top + 1) / amax, so a float block (tiny s0) has no candidate at all
    j_max = np.where(todo, np.floor(s0 * (top + 1) / np.where(todo, amax, 1.0) + 1e-6), 0).astype(np.int64)
    for j in range(1, int(j_max.max(initial=0)) + 1):
        idx = np.flatnonzero(todo & (j_max >= j))
        if not len(idx):
            break
        s = (s0[idx] / j).astype(np.float32)
        for sign, lo, hi in ((1.0, -top - 1, top), (-1.0, -top - 1, top)):
            ok = _fits(wb[idx], sign * s, lo, hi)
            hit = idx[ok & todo[idx]]
            steps[hit] = sign * s[ok & todo[idx]]
            todo[hit] = False
    if todo.any():
        return None
    return _fp16_if_fits(wb, steps, -top - 1, top)[0]


def affine_steps(wb: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, offsets) [M] of blocks wb [M, B] whose values all lie on min + c s, c = 0..15; None when some
    block's do not."""
    lo, hi = wb.min(-1), wb.max(-1)
    distinct = 1 + (np.diff(np.sort(wb, axis=-1), axis=-1) > 0).sum(-1)
    if np.any(distinct > LEVELS):
        return None                                   # more values than 4 bits hold (a float or a 5-8 bit block)
    steps = np.zeros(len(wb), np.float32)
    todo = hi > lo                                    # constant blocks: step 0, every code 0, offset = the value
    for c in range(LEVELS - 1, 0, -1):
        idx = np.flatnonzero(todo)
        if not len(idx):
            break
        s = ((hi[idx] - lo[idx]) / c).astype(np.float32)
        ok = _fits(wb[idx], s, 0, LEVELS - 1, lo[idx])
        steps[idx[ok]] = s[ok]
        todo[idx[ok]] = False
    if todo.any():
        return None
    return _fp16_if_fits(wb, steps, 0, LEVELS - 1, lo.astype(np.float32))


def _fp16_if_fits(wb: np.ndarray, steps: np.ndarray, lo: int, hi: int,
                  offsets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per block, the steps (and offsets) rounded to fp16 where they reproduce it as well as the float32 ones, to
    an ulp of its largest value; the float32 ones elsewhere."""
    s16 = steps.astype(np.float16).astype(np.float32)
    m16 = None if offsets is None else offsets.astype(np.float16).astype(np.float32)
    half = _error(wb, s16, lo, hi, m16) <= _error(wb, steps, lo, hi, offsets) + ULP * np.abs(wb).max(-1)
    kept = None if offsets is None else np.where(half, m16, offsets).astype(np.float32)
    return np.where(half, s16, steps).astype(np.float32), kept


def _error(wb: np.ndarray, s: np.ndarray, lo: int, hi: int, offset: np.ndarray | None = None) -> np.ndarray:
    """Per block [M]: max |w - its value rounded onto step s [M] (from offset), codes clipped to lo..hi|."""
    base = 0.0 if offset is None else offset[:, None]
    safe = np.where(s != 0, s, 1.0)[:, None]
    q = np.where(s[:, None] != 0, np.clip(np.rint((wb - base) / safe), lo, hi), 0.0)
    return np.abs(q * s[:, None] + base - wb).max(-1)


def fit(w: np.ndarray, scheme: Scheme) -> QuantizedWeight | None:
    """w [N, K] stored exactly on its own grid in `scheme` (symmetric 4/8-bit, or 4-bit with offsets), or None
    when some block of it lies on no such grid (K must be a multiple of the block size)."""
    n, k = w.shape
    bl = scheme.block_size
    if bl == 0 or k % bl or not (scheme.symmetric or scheme.offsets):
        return None
    nb = k // bl
    codes = np.empty((n, k), np.uint8)
    scales = np.empty((n, nb), np.float32)
    offsets = np.empty((n, nb), np.float32) if scheme.offsets else None
    zp = np.full((n, nb), 0 if scheme.offsets else scheme.mid, np.uint8)
    for sl in row_chunks(n, k):
        wb = to_blocks(np.asarray(w[sl], np.float32), bl)
        flat = wb.reshape(-1, bl)
        if scheme.offsets:
            found = affine_steps(flat)
            if found is None:
                return None
            scales[sl], offsets[sl] = (a.reshape(-1, nb) for a in found)  # type: ignore[index]
            codes[sl] = codes_for(wb, scales[sl], zp[sl], scheme, offsets[sl]).reshape(-1, k)  # type: ignore[index]
        else:
            found_s = symmetric_steps(flat, scheme.bits)
            if found_s is None:
                return None
            scales[sl] = found_s.reshape(-1, nb)
            codes[sl] = codes_for(wb, scales[sl], zp[sl], scheme).reshape(-1, k)
    return QuantizedWeight(scheme, k, codes, scales, zp, offsets)
