"""The head's logits columns and the token ids they stand for (manifest format 12, `logit_columns`).

A head quantized by rows (`--lm-head-int8-rows`, quant/headsplit.py) computes its int8 rows and its int4 rows
as two matmuls and concatenates them: column j of its logits is token `ids[j]`, the int8 rows' ids ascending,
then the int4 rows' ids ascending. Putting those columns back in vocabulary order inside the graph (Expand +
GatherElements over [n, V]) cost 0.03-0.07 ms a step and 0.2-1.2 ms per 9- or 17-row verification (SmolLM2,
Qwen2.5-0.5B shape; onnxruntime 1.32, 2 threads: bench/head_columns.py); greedy decoding needs one id, not the
vector in order. So the graph hands over the columns as computed, and this class reads them:

- `token(logits)`: the greedy pick, as `sampling.argmax_checked` on the vocabulary-order vector would pick it:
  the largest logit, ties to the lower token id, non-finite picks rejected. Columns ascend in id within each run
  (2 runs for a split head), so np.argmax per run already finds the lowest-id maximum of its run; across runs
  the maxima are compared and equal ones go to the lower id. One pass over the logits, as before.
- `vocab(logits)`: [..., V] in vocabulary order (a new array; np.take), for everything else: sampling, the
  sampled acceptance of speculative decoding, diffs and quantize's checks.

An export without the key (every fp32 export, every quantized head but a split one) has `ids` None: `token` is
`argmax_checked` and `vocab` returns its input.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .errors import EdgeError, need
from .sampling import argmax_checked

# a permutation with more ascending runs than this is read back by `vocab` before argmax (no export writes one)
MAX_RUNS = 16


class Columns:
    """Column j of a head's logits = token `ids[j]` (None: column j is token j)."""

    def __init__(self, ids: np.ndarray | None) -> None:
        self.ids = ids
        self.pos: np.ndarray | None = None   # [V]: the column of token t
        self.runs: list[tuple[int, int]] = []
        if ids is None:
            return
        v = ids.shape[0]
        need(ids.ndim == 1 and v >= 1, f"logit_columns: expected a 1-D list of token ids, got shape {ids.shape}")
        pos = np.full(v, -1, np.int64)
        inside = (ids >= 0) & (ids < v)
        need(bool(inside.all()), f"logit_columns: ids must lie in 0..{v - 1}")
        pos[ids] = np.arange(v)
        need(bool((pos >= 0).all()), "logit_columns: expected every token id exactly once")
        self.pos = pos
        cuts = np.flatnonzero(np.diff(ids) < 0) + 1   # a run ends where the ids stop ascending
        bounds = [0, *cuts.tolist(), v]
        self.runs = list(zip(bounds[:-1], bounds[1:], strict=True))

    @classmethod
    def read(cls, path: Path | None, vocab_size: int) -> Columns:
        """From a `logit_columns` file (int32 little-endian [V]); None: the identity."""
        if path is None:
            return cls(None)
        raw = path.read_bytes()
        need(len(raw) == 4 * vocab_size, f"{path}: expected {vocab_size} int32 token ids ({4 * vocab_size} bytes), "
                                         f"got {len(raw)} bytes")
        try:
            return cls(np.frombuffer(raw, "<i4").astype(np.int64))
        except EdgeError as err:
            raise EdgeError(f"{path}: {err}") from None

    @property
    def identity(self) -> bool:
        return self.ids is None

    def token(self, logits: np.ndarray) -> int:
        """The greedy token of one logits row [V] in column order (module docstring)."""
        if self.ids is None:
            return argmax_checked(logits)
        if len(self.runs) > MAX_RUNS:
            return argmax_checked(self.vocab(logits))
        picks = [(float(logits[j]), int(self.ids[j])) for j in
                 (start + int(np.argmax(logits[start:end])) for start, end in self.runs)]
        best = max(v for v, _ in picks)
        if not math.isfinite(best) or any(v != v for v, _ in picks):   # NaN, +inf or all -inf: its one error
            return argmax_checked(self.vocab(logits))
        return min(t for v, t in picks if v == best)

    def vocab(self, logits: np.ndarray) -> np.ndarray:
        """logits [..., V] in column order -> vocabulary order (the input itself for the identity)."""
        if self.pos is None:
            return logits
        return np.take(logits, self.pos, axis=-1)
