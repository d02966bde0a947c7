"""What `edgellm quantize` prints and records: the per-weight table, size totals, and logit comparisons
(top-1 agreement, KL) of a quantized export against its fp32 source; the metrics are runtime/metrics.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgellm.runtime.metrics import kl_divergence

from .plan import WeightReport

MB = 1e6


@dataclass(frozen=True)
class LogitComparison:
    positions: int
    top1_agreement: float      # fraction of positions where both argmaxes agree
    mean_kl: float
    max_kl: float
    max_abs_diff: float        # max |logit_q - logit_fp32|

    def to_dict(self) -> dict:
        return {"positions": self.positions, "top1_agreement": round(self.top1_agreement, 6),
                "mean_kl": float(f"{self.mean_kl:.4g}"), "max_kl": float(f"{self.max_kl:.4g}"),
                "max_abs_logit_diff": float(f"{self.max_abs_diff:.4g}")}


def compare_logits(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> LogitComparison:
    """Compare per-sequence logits [T, V] of the fp32 (`ref`) and quantized (`got`) exports."""
    r, g = np.concatenate(list(ref)), np.concatenate(list(got))
    kl = kl_divergence(r, g)
    return LogitComparison(len(r), float(np.mean(r.argmax(-1) == g.argmax(-1))), float(kl.mean()),
                           float(kl.max()), float(np.abs(r.astype(np.float64) - g).max()))


def weight_table(rows: Sequence[tuple[str, WeightReport]]) -> list[str]:
    """(display name, report) rows -> aligned text lines, with a total of the weights' bytes."""
    width = max([len("weight")] + [len(name) for name, _ in rows])
    lines = [f"{'weight':<{width}}  {'scheme':<18} {'MB fp32':>9} {'MB quant':>9} {'ratio':>6} "
             f"{'max abs err':>11} {'rel RMS err':>11}"]
    for name, r in rows:
        after = "shared" if r.shared_with else f"{r.bytes_after / MB:9.3f}"
        ratio = f"{r.bytes_after / r.bytes_before:6.3f}" if r.bytes_before and not r.shared_with else ""
        lines.append(f"{name:<{width}}  {r.scheme:<18} {r.bytes_before / MB:9.3f} {after:>9} {ratio:>6} "
                     f"{r.max_abs_err:11.3g} {r.rel_rms_err:11.3g}")
    before = sum(r.bytes_before for _, r in rows if not r.shared_with)
    after = sum(r.bytes_after for _, r in rows)
    lines.append(f"{'total':<{width}}  {'':<18} {before / MB:9.3f} {after / MB:9.3f} "
                 f"{(after / before if before else 1.0):6.3f}")
    return lines


def ratio_by_kind(rows: Sequence[tuple[str, WeightReport]]) -> dict[str, float]:
    """bytes after / before of the quantized linears (lm_head apart) and of everything quantized."""
    def ratio(sel: list[WeightReport]) -> float:
        before = sum(r.bytes_before for r in sel)
        return sum(r.bytes_after for r in sel) / before if before else 1.0
    quantized = [r for _, r in rows if r.scheme != "fp32" and not r.shared_with]
    linears = [r for name, r in rows if r.scheme != "fp32" and r.op != "Gather"
               and not name.startswith("lm_head.")]
    return {"linears": ratio(linears), "quantized": ratio(quantized)}
