"""Log-probabilities, KL divergence and perplexity of logits: numpy only, in float64, for every host-side user
(the diff's report, quantize's check, the benchmarks) and any runtime caller.

Target convention: logits row i predicts token i+1 (a causal LM's logits for tokens [T] are [T, V] and the
last row predicts the token after them), so `perplexity(logits, tokens)` scores tokens[1:] under logits[:-1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BLOCK = 16  # rows per block: the float64 [16, V] temporaries stay ~20 MB each even at V = 152k


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> log-probabilities in float64 (max-subtracted, so large logits do not overflow)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """KL per row from log-probabilities [T, V] -> [T]; p = 0 terms contribute 0 (p log p -> 0)."""
    p = np.exp(lp)
    terms = np.where(p > 0, p * (lp - lq), 0.0)
    return np.maximum(terms.sum(axis=-1), 0.0)  # rounding can give -1e-17 for identical rows


def kl_divergence(ref_logits: np.ndarray, got_logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_got) per position: [T, V] x [T, V] -> [T] nats, sum_v p (log p - log q)."""
    return kl_rows(log_softmax(ref_logits), log_softmax(got_logits))


def perplexity(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """exp(mean NLL) of tokens[1:] under logits[:-1]: logits [T, V] of tokens [T], row i predicting token i+1
    (the module's convention; the last row predicts past the text and is not scored). inf when the mean NLL
    overflows (a broken export)."""
    targets = np.asarray(tokens[1:], np.int64)
    nll = [-log_softmax(logits[i:i + BLOCK])[np.arange(len(targets[i:i + BLOCK])), targets[i:i + BLOCK]]
           for i in range(0, len(targets), BLOCK)]
    mean = float(np.concatenate(nll).mean())
    return math.exp(mean) if mean < 700 else math.inf
