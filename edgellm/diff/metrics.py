"""Accuracy metrics: numpy functions comparing a reference (PyTorch) against an export, in float64.

Tensor errors (per-layer hidden states, K/V rows): cosine similarity, max abs diff, relative RMS error
||got - ref|| / ||ref||, SNR in dB = 10 log10(sum ref^2 / sum (got - ref)^2).

Logit metrics follow llama.cpp's `--kl-divergence` report: KL(P_ref || P_export) per position, top-1
agreement ("same top p"), top-5 overlap, and Δp. Here Δp is the probability the export gives the
reference's top token minus the reference's own probability for it (negative = the export is less sure of
the reference's choice); llama.cpp uses the text's next token instead, which `ppl` covers. log_softmax, KL and
perplexity (row i predicts token i+1) are runtime/metrics.py's.

Drift: `first_jump` names the first layer whose error jumps; the rule is in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgellm.runtime.metrics import BLOCK, kl_divergence, kl_rows, log_softmax, perplexity

__all__ = ["kl_divergence", "log_softmax", "perplexity"]  # (runtime/metrics.py's, used here and by quantize)

PERCENTILES = (50, 90, 95, 99)


def tensor_errors(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """{cosine, max_abs, rel_rms, snr_db} of `got` against `ref` (any equal shapes, flattened).

    An exactly zero error gives snr_db = +inf; NaN/Inf in `got` gives the worst value of every metric.
    """
    a = np.asarray(ref, np.float64).ravel()
    b = np.asarray(got, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: reference {np.shape(ref)} vs export {np.shape(got)}")
    if not np.all(np.isfinite(b)):
        return {"cosine": math.nan, "max_abs": math.inf, "rel_rms": math.inf, "snr_db": -math.inf}
    err = b - a
    ref_energy, got_energy, err_energy = float(a @ a), float(b @ b), float(err @ err)
    if ref_energy > 0 and got_energy > 0:
        cosine = float(a @ b) / (math.sqrt(ref_energy) * math.sqrt(got_energy))
    else:  # a zero vector has no direction: similar only to another zero vector
        cosine = 1.0 if ref_energy == got_energy else 0.0
    if err_energy == 0.0:
        rel, snr = 0.0, math.inf
    elif ref_energy == 0.0:
        rel, snr = math.inf, -math.inf
    else:
        rel = math.sqrt(err_energy / ref_energy)
        snr = 10.0 * math.log10(ref_energy / err_energy)
    return {"cosine": cosine, "max_abs": float(np.max(np.abs(err))) if err.size else 0.0,
            "rel_rms": rel, "snr_db": snr}


def summarize(values: np.ndarray) -> dict[str, float]:
    """mean, std, min, median/p90/p95/p99 (linear interpolation) and max of a 1-D array."""
    v = np.asarray(values, np.float64)
    out = {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min())}
    for q in PERCENTILES:
        out["median" if q == 50 else f"p{q}"] = float(np.percentile(v, q))
    out["max"] = float(v.max())
    return out


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """[T, V] -> [T, k] ids of the k largest logits, largest first (ties towards the lower id).

    argpartition first (O(V) per row: V reaches ~152k), then a sort of the k survivors.
    """
    x = np.asarray(logits, np.float64)
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k] if k < x.shape[-1] else np.tile(np.arange(k), (len(x), 1))
    vals = np.take_along_axis(x, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def _block(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-position (kl, top1, top5 overlap, Δp) and the block's max |Δlogit|, for ref/got [b, V]."""
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = kl_rows(lp, lq)
    kl[~np.all(np.isfinite(got), axis=-1)] = math.inf  # NaN/Inf logits: maximally wrong, not "nan"
    top = ref.argmax(-1)  # argmax: the first (lowest) id among ties, as greedy picks
    top1 = top == got.argmax(-1)
    overlap = np.array([len(set(a) & set(b)) / 5.0
                        for a, b in zip(top_k_ids(ref, 5), top_k_ids(got, 5), strict=True)])
    rows = np.arange(len(ref))
    dp = np.exp(lq[rows, top]) - np.exp(lp[rows, top])
    return kl, top1, overlap, dp, np.max(np.abs(got - ref))


def logit_metrics(ref_logits: np.ndarray, got_logits: np.ndarray) -> dict[str, object]:
    """Distribution metrics of the export's next-token predictions against the reference's, per position.

    ref_logits, got_logits: [T, V]. Returns kl (summary), kl_per_position [T], top1 and top5 (fractions),
    dp {mean, rms, worst} (worst = the most negative Δp), max_abs_logit. Computed in blocks of positions so
    memory stays bounded for large vocabularies.
    """
    n = len(ref_logits)
    parts = [_block(ref_logits[i:i + BLOCK], got_logits[i:i + BLOCK]) for i in range(0, n, BLOCK)]
    kl, top1, overlap, dp = (np.concatenate([p[j] for p in parts]) for j in range(4))
    return {
        "n_positions": int(n),
        "kl": summarize(kl),
        "kl_per_position": [float(x) for x in kl],
        "top1": float(top1.mean()),
        "top5": float(overlap.mean()),
        "dp": {"mean": float(dp.mean()), "rms": float(np.sqrt((dp ** 2).mean())), "worst": float(dp.min())},
        "max_abs_logit": float(max(p[4] for p in parts)),
    }


def first_jump(errors: Sequence[float | None], factor: float, floor: float,
               baseline: float | None = None) -> int | None:
    """The first layer whose error jumps, or None.

    Layer i jumps when errors[i] > floor AND errors[i] > factor * median(errors[:i] + [baseline]) —
    the median over the layers before it and the baseline (the error of the embedding output when known;
    0 otherwise, so layer 0 jumps as soon as it is above the floor). None entries (no data) never jump and
    are left out of later medians. The floor keeps float noise (fp32 errors of ~1e-7) from ever counting.
    """
    seen = [0.0 if baseline is None else float(baseline)]
    for i, e in enumerate(errors):
        if e is None:
            continue
        if e > floor and e > factor * float(np.median(seen)):
            return i
        seen.append(float(e))
    return None


def largest_jump(errors: Sequence[float | None], floor: float, baseline: float | None = None) -> int | None:
    """The layer with the largest error growth errors[i] / max(previous error, floor), if any exceeds 1.

    Complements `first_jump`: with int8 every layer is above the floor from layer 0 on, and this names the
    one layer that adds the most error on top of what came in.
    """
    prev = 0.0 if baseline is None else float(baseline)
    best, best_ratio = None, 1.0
    for i, e in enumerate(errors):
        if e is None:
            continue
        ratio = e / max(prev, floor)
        if ratio > best_ratio:
            best, best_ratio = i, ratio
        prev = e
    return best
