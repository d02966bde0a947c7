"""What one teacher-forced pass over the evaluation tokens records, for PyTorch and an export alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    """Real rows only (padding of a last prefill chunk is dropped); T = number of evaluation tokens."""

    logits: np.ndarray                  # [T, V] float32: row t predicts token t+1
    embed: np.ndarray | None            # [T, D] the embedding output (None: not observable in the export)
    hidden: list[np.ndarray] | None     # per layer [T, D]: the hidden state after that layer
    keys: list[np.ndarray]              # per layer [n_kv, T, hd]: the K rows the layer wrote into the cache
    values: list[np.ndarray]            # per layer [n_kv, T, hd]


def join_rows(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """Concatenate per-chunk arrays along the token axis (1 for [n_kv, S, hd], 0 for [S, D])."""
    return np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
