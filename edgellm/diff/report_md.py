"""The terminal summary: one Markdown table row per variant, the verdict paragraph (verdict.py) and the gate."""

from __future__ import annotations

import math
from typing import Any

COLUMNS = ("variant", "top1", "mean KL", "p99 KL", "PPL", "ΔPPL", "first drift layer", "greedy agreement")


def fmt(x: float | None, spec: str = ".4g") -> str:
    """A number for a table cell: '-' for missing, 'inf'/'nan' spelled out."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return format(x, spec)


def summary_row(v: dict[str, Any]) -> list[str]:
    """The cells of one variant's row (shared with the HTML summary table)."""
    lg, ppl, greedy, layers = v["logits"], v["ppl"], v["greedy"], v["per_layer"]
    drift = layers["first_drift_layer"]
    return [
        v["name"],
        f"{fmt(100 * lg['top1'], '.2f')} %",
        fmt(lg["kl"]["mean"], ".3g"),
        fmt(lg["kl"]["p99"], ".3g"),
        fmt(ppl["ppl"], ".4g"),
        f"{fmt(ppl['delta'], '+.4g')} ({fmt(100 * ppl['delta_rel'], '+.2f')} %)",
        "none" if drift is None else f"layer {drift}",
        f"{greedy['agreed']}/{greedy['total']} ({fmt(100 * greedy['agreement'], '.1f')} %)",
    ]


def summary_markdown(report: dict[str, Any]) -> str:
    rows = [list(COLUMNS), ["---"] * len(COLUMNS)] + [summary_row(v) for v in report["variants"]]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    ref = ", ".join(f"{fmt(p, '.4g')} (max_seq {s})" for s, p in report["reference"]["ppl"].items())
    lines.append(f"\nPyTorch PPL: {ref} on {report['text']['n_tokens']} tokens ({report['text']['source']} text)")
    verdict = report.get("verdict")
    if verdict is not None:
        lines.append(f"\nverdict: {verdict['text']}\n")
    gate = report.get("gate")
    if gate is not None:
        if gate["passed"]:
            lines.append(f"gate passed: {', '.join(gate['conditions'])}")
        for f in gate["failed"]:
            lines.append(f"GATE FAILED: {f['variant']}: {f['metric']} = {fmt(f['value'], '.4g')} "
                         f"(fail if {f['condition']})")
    return "\n".join(lines)
