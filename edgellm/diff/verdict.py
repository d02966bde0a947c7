"""The report's verdict: which variant to ship under a quality bar, which layers carry the error, and the
`edgellm quantize` command that would cut it. One paragraph at the top of report.html and under the Markdown
summary; a structured `verdict` object in report.json (see report_json).

The bar is the report's `--fail-if` gate when one was given, else DEFAULT_BAR (the README's example gate).
"Carrying the error": a layer's growth is its relative RMS error over the error it received
(error[i] / max(error[i-1], jump floor), the embedding output's error before layer 0): the factor by which
the layer multiplies the error, the measure of `metrics.largest_jump`. Those layers get int8 linears
(`--int8-layers`, int4 models) or stay fp32 (`--keep "layers.N.*"`, int8 models); an int4 lm_head gets
`--lm-head int8` (README: it roughly halves an int4 model's KL). Pure functions of the report dict and the
facts `export_facts` reads from each export's manifest (sizes, per-weight errors), so tests give numbers.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from edgellm.runtime.errors import EdgeError
from edgellm.runtime.fileio import sha256_file
from edgellm.runtime.manifest import MANIFEST, read_manifest

from .fix_command import change_words, free_path, quantize_argv
from .gate import Condition, evaluate_gate, parse_gate

BAR_KL, BAR_TOP1 = 0.05, 0.9   # the README's example gate: mean KL above or top-1 below fails
DEFAULT_BAR = f"kl>{BAR_KL:g},top1<{BAR_TOP1:g}"
MAX_FIX_LAYERS = 3          # a fix names at most this many layers (the rest is usually noise)
MB = 1e6
# how each gate metric reads in a sentence, and the comparison that passes (the inverse of the failure)
_NAMES = {"kl": "mean KL", "kl_p99": "p99 KL", "kl_max": "max KL", "top1": "top-1", "top5": "top-5 overlap",
          "ppl_delta": "ΔPPL", "greedy": "greedy agreement", "rel_rms_max": "worst layer rel RMS"}
_PASSING = {">": "≤", ">=": "<", "<": "≥", "<=": ">"}


def export_facts(path: str | Path) -> dict[str, Any] | None:
    """What the verdict needs from an export's manifest: total bytes, per-weight relative RMS quantization
    errors, the manifest's sha256 (to find a quantized export's fp32 source). None when it cannot be read."""
    path = Path(path)
    try:
        m = read_manifest(path, verify=False)  # the diff verified the files already
        sha = sha256_file(path / MANIFEST)
    except (EdgeError, OSError):
        return None
    weights = (m.quantization or {}).get("weights") or {}
    return {"bytes": sum(f.bytes for f in m.files.values()), "manifest_sha256": sha,
            "weights": {k: float(w.get("rel_rms_err") or 0.0) for k, w in weights.items() if isinstance(w, dict)}}


_PERCENT = ("top1", "top5", "greedy", "ppl_delta")  # fractions, shown as percentages


def _value(metric: str, value: float) -> str:
    return f"{100 * value:.3g} %" if metric in _PERCENT else f"{value:.3g}"


def bar_text(conditions: list[Condition]) -> str:
    """"kl>0.05,top1<0.9" -> "mean KL ≤ 0.05 and top-1 ≥ 90 %" (what passing means)."""
    return " and ".join(f"{_NAMES.get(c.metric, c.metric)} {_PASSING[c.op]} {_value(c.metric, c.threshold)}"
                        for c in conditions)


def _miss(failure: dict[str, Any]) -> str:
    """A failed condition as "top-1 78.1 % < 90 %"."""
    m = failure["metric"]
    return f"{_NAMES.get(m, m)} {_value(m, failure['value'])} {failure['op']} {_value(m, failure['threshold'])}"


def _mb(n: int | None) -> str:
    return "size unknown" if n is None else f"{n / MB:.2f} MB"


def error_layers(per_layer: dict[str, Any], floor: float) -> list[dict[str, Any]]:
    """Layers sorted by growth (see module doc), largest first; only layers that grow the error (> 1x)
    above the floor. Each: {layer, growth, error}."""
    embed = per_layer.get("embed")
    prev = embed["rel_rms"] if embed is not None else 0.0
    out = []
    for entry in per_layer["layers"]:
        err = entry.get("error")
        if err is None:
            continue
        growth = err / max(prev, floor) if math.isfinite(err) else math.inf
        if growth > 1.0 and err > floor:
            out.append({"layer": entry["layer"], "growth": growth, "error": err})
        prev = err
    return sorted(out, key=lambda e: -e["growth"])


def _fix_layers(ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The top layer, and the next ones growing the error at least half as much (at most MAX_FIX_LAYERS)."""
    if not ranked:
        return []
    top = ranked[0]["growth"]
    return [e for e in ranked if e["growth"] >= 0.5 * top][:MAX_FIX_LAYERS]


EXACT = 1e-6   # a weight's relative error at or below this: it came back exactly (quantize --block-min)


def _source(variant: dict[str, Any], variants: list[dict[str, Any]], facts: dict[str, Any]) -> str | None:
    """The fp32 export `variant` was quantized from: the fp32 variant whose manifest it records, else the
    only fp32 variant of the report, else None."""
    want = ((variant.get("quantization") or {}).get("source") or {}).get("manifest_sha256")
    fp32 = [v for v in variants if v.get("quantization") is None]
    for v in fp32:
        if want and (facts.get(v["name"]) or {}).get("manifest_sha256") == want:
            return v["path"]
    return fp32[0]["path"] if len(fp32) == 1 else None


def _target(rows: list[dict[str, Any]], ship: dict[str, Any] | None) -> dict[str, Any] | None:
    """The variant whose error is worth explaining: the smallest quantized one that misses the bar and is
    smaller than the shipped one (fixing it saves space), else the shipped one if quantized, else the
    worst failing one."""
    smaller = [r for r in rows if not r["passes"] and r["quantized"]
               and (ship is None or (r["bytes"] or math.inf) < (ship["bytes"] or math.inf))]
    if smaller:  # the smallest; among equal sizes the closest to the bar
        return min(smaller, key=lambda r: (r["bytes"] or math.inf, r["kl"] if math.isfinite(r["kl"]) else math.inf))
    if ship is not None and ship["quantized"]:
        return ship
    failing = [r for r in rows if not r["passes"]]
    return max(failing, key=lambda r: r["kl"] if math.isfinite(r["kl"]) else math.inf) if failing else None


def _pick_sentences(rows: list[dict[str, Any]], ship: dict[str, Any] | None, bar: str, origin: str) -> list[str]:
    """What to ship (or that nothing meets the bar), the better-quality alternative, the smaller misses."""
    if ship is not None:
        ratio = f", {ship['size_vs_fp32']:.2f}x of fp32" if ship["size_vs_fp32"] else ""
        text = [f"Ship {ship['name']} ({_mb(ship['bytes'])}{ratio}): the smallest variant with {bar} ({origin}); "
                f"its mean KL is {ship['kl']:.3g}, top-1 {100 * ship['top1']:.1f} %."]
        better = [r for r in rows if r["passes"] and r is not ship and r["kl"] < ship["kl"]]
        if better:
            b = min(better, key=lambda r: (r["bytes"] or math.inf))
            text.append(f"For less error, {b['name']} ({_mb(b['bytes'])}) has mean KL {b['kl']:.3g}.")
    else:
        best = min(rows, key=lambda r: r["kl"] if math.isfinite(r["kl"]) else math.inf)
        text = [f"No variant meets {bar} ({origin}); the closest is {best['name']} ({_mb(best['bytes'])}, "
                f"mean KL {best['kl']:.3g}, top-1 {100 * best['top1']:.1f} %)."]
    misses = [f"{r['name']} ({_mb(r['bytes'])}: {', '.join(r['failed'])})" for r in rows if not r["passes"]
              and (ship is None or (r["bytes"] or math.inf) < (ship["bytes"] or math.inf))]
    if misses:
        text.append(f"{'Smaller but missing' if ship else 'Missing'} the bar: {'; '.join(misses)}.")
    return text


def _explain(v: dict[str, Any], variants: list[dict[str, Any]], facts: dict[str, Any],
             floor: float) -> tuple[dict[str, Any], dict[str, Any] | None, list[str]]:
    """(error, fix, sentences) for variant `v`: the layers that grow its error, their worst weights, and
    the `edgellm quantize` command that gives them more bits (None when there is nothing to change)."""
    ranked = _fix_layers(error_layers(v["per_layer"], floor))
    weights = (facts.get(v["name"]) or {}).get("weights") or {}
    for e in ranked:
        mine = {k: w for k, w in weights.items() if k.startswith(f"layers.{e['layer']}.")}
        if mine:
            e["worst_weight"] = max(mine, key=mine.get)
            e["weight_rel_rms_err"] = mine[e["worst_weight"]]
    text = []
    if ranked:
        parts = [f"layer {e['layer']} (x{e['growth']:.3g} to {e['error']:.3g}"
                 + (f"; its worst weight {e['worst_weight']}, rel. error {e['weight_rel_rms_err']:.3g}"
                    if "worst_weight" in e else "") + ")" for e in ranked]
        text.append(f"Most of {v['name']}'s error enters at {', '.join(parts)}: the layer multiplies the "
                    f"relative RMS error it receives by that factor.")
    error = {"variant": v["name"], "layers": ranked}
    options = (v.get("quantization") or {}).get("options")
    if v.get("quantization") is None:
        if ranked:
            text.append(f"{v['name']} is fp32, so this is no quantization error: re-export it and read the "
                        f"verification edgellm export prints for layer {ranked[0]['layer']}.")
        return error, None, text
    if not isinstance(options, dict) or "bits" not in options:
        return error, None, text
    layers = [e["layer"] for e in ranked if e.get("weight_rel_rms_err", 1.0) > EXACT]
    if ranked and not layers:  # block minima that kept a grid: more bits there would not lower the error
        text.append(f"{v['name']}'s weights in those layers come back exactly (rel. error 0): what they grow comes "
                    f"from elsewhere, onnxruntime's int8 activations (accuracy level 4) and the quantized embedding "
                    f"table and lm_head, not from their rounding.")
        return error, None, text
    changes = change_words(options, layers)
    if changes == "the same options":
        return error, None, text  # nothing left to give more bits to
    source = _source(v, variants, facts)
    out = free_path(f"{v['path'].rstrip('/')}-fix")
    argv = quantize_argv(source or "FP32_EXPORT", out, options, layers)
    command = shlex.join(argv)
    hint = "" if source else "; FP32_EXPORT: the fp32 export it was quantized from"
    text.append(f"To cut it ({changes}{hint}), quantize again and diff the result: `{command}`")
    return error, {"variant": v["name"], "argv": argv, "command": command, "output": out, "layers": layers,
                   "pasteable": source is not None}, text


def build_verdict(report: dict[str, Any], facts: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The verdict object (structured fields + `text`) from the report and `{variant name: export_facts}`."""
    gate = report.get("gate")
    conditions = parse_gate(",".join(gate["conditions"]) if gate else DEFAULT_BAR)
    variants = report["variants"]
    fp32_bytes = next(((facts.get(v["name"]) or {}).get("bytes") for v in variants
                       if v.get("quantization") is None and facts.get(v["name"])), None)
    rows = []
    for v in variants:
        failed = [_miss(f) for f in evaluate_gate(conditions, [v])]
        size = (facts.get(v["name"]) or {}).get("bytes")
        rows.append({"name": v["name"], "bytes": size, "passes": not failed, "failed": failed,
                     "kl": v["logits"]["kl"]["mean"], "top1": v["logits"]["top1"],
                     "quantized": v.get("quantization") is not None,
                     "size_vs_fp32": size / fp32_bytes if size and fp32_bytes else None})
    passing = [r for r in rows if r["passes"]]
    ship = min(passing, key=lambda r: (r["bytes"] or math.inf, r["kl"])) if passing else None
    origin = "the --fail-if gate" if gate else f"the default bar; set yours with --fail-if, e.g. \"{DEFAULT_BAR}\""
    text = _pick_sentences(rows, ship, bar_text(conditions), origin)
    error, fix = None, None
    target = _target(rows, ship)
    if target is not None:
        v = next(x for x in variants if x["name"] == target["name"])
        error, fix, more = _explain(v, variants, facts, report["settings"]["jump_floor"])
        text += more
    return {"bar": {"conditions": [str(c) for c in conditions], "source": "--fail-if" if gate else "default"},
            "variants": rows, "ship": None if ship is None else {k: ship[k] for k in ("name", "bytes", "size_vs_fp32")},
            "error": error, "fix": fix, "text": " ".join(text)}


def add_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Set report["verdict"] from the report and the exports it names; returns the verdict."""
    facts = {v["name"]: export_facts(v["path"]) for v in report["variants"]}
    report["verdict"] = build_verdict(report, facts)
    return report["verdict"]
