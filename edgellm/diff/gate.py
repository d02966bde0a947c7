"""`--fail-if`: accuracy gates for CI, e.g. "kl>0.05,top1<0.9,ppl_delta>0.05".

A gate is a comma-separated list of conditions `METRIC OP NUMBER` (OP one of > < >= <=), each describing a
failure; it is checked against every variant and fails if any condition holds for any of them. A metric
that is not finite (NaN logits) always fails. Metric names are the keys of `METRICS`.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgellm.runtime.errors import EdgeError

# metric name -> (how to read it from a variant's report dict, what it means)
METRICS: dict[str, tuple[Callable[[dict[str, Any]], float], str]] = {
    "kl": (lambda v: v["logits"]["kl"]["mean"], "mean KL(PyTorch || export) per position, nats"),
    "kl_p99": (lambda v: v["logits"]["kl"]["p99"], "99th percentile of the per-position KL"),
    "kl_max": (lambda v: v["logits"]["kl"]["max"], "largest per-position KL"),
    "top1": (lambda v: v["logits"]["top1"], "fraction of positions whose argmax agrees (0..1)"),
    "top5": (lambda v: v["logits"]["top5"], "mean overlap of the top-5 token sets (0..1)"),
    "dp_mean": (lambda v: v["logits"]["dp"]["mean"], "mean Δp of the reference's top token"),
    "dp_worst": (lambda v: v["logits"]["dp"]["worst"], "most negative Δp of the reference's top token"),
    "ppl": (lambda v: v["ppl"]["ppl"], "perplexity of the export on the evaluation text"),
    "ppl_delta": (lambda v: v["ppl"]["delta_rel"], "relative perplexity change (PPL_export / PPL_torch - 1)"),
    "greedy": (lambda v: v["greedy"]["agreement"], "fraction of greedy tokens identical to PyTorch's (0..1)"),
    "rel_rms_max": (lambda v: v["per_layer"]["worst_rel_rms"], "largest per-layer relative RMS error"),
}

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def fails(self, value: float) -> bool:
        return not math.isfinite(value) or _OPS[self.op](value, self.threshold)


def parse_gate(text: str) -> list[Condition]:
    """Parse "kl>0.05,top1<0.9" into conditions; EdgeError naming --fail-if on bad syntax or metric."""
    conditions = []
    for part in text.split(","):
        match = _CONDITION.match(part)
        if not match:
            raise EdgeError(f"--fail-if: cannot parse {part.strip()!r}; expected METRIC OP NUMBER "
                            f"like 'kl>0.05' (OP one of > < >= <=), conditions separated by commas")
        name, op, number = match.groups()
        if name not in METRICS:
            raise EdgeError(f"--fail-if: unknown metric {name!r}; expected one of {', '.join(METRICS)}")
        conditions.append(Condition(name, op, float(number)))
    return conditions


def evaluate_gate(conditions: list[Condition], variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failed (variant, condition, value) triples, as JSON-ready dicts; empty when the gate passes.

    A metric a variant cannot provide (rel_rms_max of a model-granularity export has no hidden states
    but still has K/V errors; None only when nothing per-layer exists) fails the condition: a CI gate must
    not pass silently on missing data.
    """
    failed = []
    for variant in variants:
        for cond in conditions:
            value = METRICS[cond.metric][0](variant)
            value = math.nan if value is None else float(value)
            if cond.fails(value):
                failed.append({"variant": variant["name"], "condition": str(cond), "metric": cond.metric,
                               "op": cond.op, "threshold": cond.threshold, "value": value})
    return failed
