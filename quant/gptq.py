"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
2022): error-compensating rounding of one linear weight, given the Hessian of its layer-wise loss.

Objective, per weight W [N, K] and calibration inputs X [T, K]: minimise ||X (W - Wq)^T||^2, whose Hessian
(per output row) is H = X^T X [K, K] (`Calibrator(hessians=True)` accumulates it; the constant 2 / T
does not change the solution). Columns are quantized one at a time (OBQ); the rounding error of column i
is spread over the columns not yet quantized, weighted by the inverse Hessian:
    err = (w_i - q_i) / Hinv[i, i];   W[:, j] -= err * Hinv[i, j]   for j > i
with Hinv the upper Cholesky factor of H^-1 (numerically stable form of the sequential inverse updates).
Lazy batch updates: inside a block of BLOCK columns only the block is updated; the rest of W gets one
matmul per block. Damping: H += damp * mean(diag H) * I (dead input channels, diag = 0, get H = 1 and
W = 0 there). Scales: group-wise, computed from the *updated* weights when the loop reaches each group
(the group lies inside the current block), by the clip search of methods.py weighted by diag(H); with
`act_order` (columns in order of decreasing diag H) the groups are static: scales from the original W,
so every group stays a contiguous run of K, as MatMulNBits stores it. Per-channel (block 0): one scale
per row from the original W. RTN's grid is searched too, so a scale is never worse than RTN's on its own
block; the compensation then makes the layer output error lower than RTN's on the calibration data.
"""

from __future__ import annotations

import numpy as np

from edgellm.runtime.errors import need

from .methods import CLIP_RATIOS, search_params
from .schemes import QuantizedWeight, Scheme, dequantize_blocks, quantize, to_blocks

BLOCK = 128          # lazy-batch width (a multiple of every group size up to 128; 256-groups use 256)
DAMP = 0.01
RATIOS = CLIP_RATIOS[CLIP_RATIOS >= 0.7]    # 13 clip ratios: the compensation recovers what a finer grid would


def _inverse_factor(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor U of (H + damp * mean(diag) I)^-1 (U^T U = H^-1), float64 [K, K]."""
    k = h.shape[0]
    mean = float(np.mean(np.diag(h))) or 1.0
    for attempt in range(6):                       # a nearly singular H: more damping until it factors
        try:
            lower = np.linalg.cholesky(h + (damp * 10 ** attempt) * mean * np.eye(k))
            inv = np.linalg.inv(lower)                                   # L^-1
            return np.linalg.cholesky(inv.T @ inv).T                     # H^-1 = L^-T L^-1
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("GPTQ: the Hessian is not positive definite even with damping")


def _group_params(w: np.ndarray, scheme: Scheme, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point [N, 1] for one group of columns w [N, g], weights [g] (diag H)."""
    s, z = search_params(w[:, None, :], scheme, weights[None, :].astype(np.float32), RATIOS)
    return s, z


def gptq_quantize(w: np.ndarray, h: np.ndarray, scheme: Scheme, act_order: bool = False,
                  damp: float = DAMP) -> QuantizedWeight:
    """Quantize w [N, K] (canonical) against the Hessian h [K, K] = sum of x^T x over calibration rows."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    need(h.shape == (k, k), f"GPTQ: Hessian must be [{k}, {k}] for a [{n}, {k}] weight, got {h.shape}")
    need(bool(np.all(np.isfinite(w))) and bool(np.all(np.isfinite(h))), "GPTQ: weight and Hessian must be finite")
    h = np.array(h, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w = w.copy()
    w[:, dead] = 0.0
    diag = np.diag(h).copy()
    g = scheme.block_size or k
    nb = scheme.n_blocks(k)
    scales = np.zeros((n, nb), np.float32)
    zps = np.zeros((n, nb), np.uint8)
    if scheme.block_size == 0 or act_order:       # static parameters from the original weight
        wb = to_blocks(w, g)
        weights = to_blocks(diag[None, :].astype(np.float32), g)[0]
        scales, zps = search_params(wb, scheme, weights, RATIOS)
    perm = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    inv_perm = np.argsort(perm)
    wp = w[:, perm]
    u = _inverse_factor(h[np.ix_(perm, perm)], damp).astype(np.float32)
    q_out = np.zeros_like(wp)                      # dequantized values, permuted order
    width = max(BLOCK, g if g <= 256 else BLOCK)
    dynamic = scheme.block_size != 0 and not act_order
    for i1 in range(0, k, width):
        i2 = min(i1 + width, k)
        w1 = wp[:, i1:i2].copy()
        err1 = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i                           # position in the permuted order
            orig = perm[col]
            blk = orig // g
            if dynamic and orig % g == 0:          # a new group starts: scales from the updated weights
                end = min(g, i2 - i1 - i)
                s, z = _group_params(w1[:, i:i + end], scheme, diag[orig:orig + end])
                scales[:, blk], zps[:, blk] = s[:, 0], z[:, 0]
            s, z = scales[:, blk:blk + 1], zps[:, blk:blk + 1]
            x = w1[:, i:i + 1]
            code = np.clip(np.rint(x / np.where(s != 0, s, 1.0)) + z, 0, scheme.qmax)
            q = dequantize_blocks(code.astype(np.uint8)[:, None, :], s, z)[:, 0, :]
            q_out[:, col] = q[:, 0]
            e = (x[:, 0] - q[:, 0]) / u1[i, i]
            w1[:, i:] -= np.outer(e, u1[i, i:])
            err1[:, i] = e
        wp[:, i2:] -= err1 @ u[i1:i2, i2:]
    # the rounded values lie on each block's grid, so re-quantizing them with the same scales is exact
    return quantize(q_out[:, inv_perm], scheme, scales, zps if not scheme.symmetric else None)


def output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """tr((W - Wq) H (W - Wq)^T) = ||X (W - Wq)^T||^2 over the calibration rows behind H."""
    d = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.sum((d @ np.asarray(h, np.float64)) * d))
