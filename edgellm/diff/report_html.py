"""report.html: one self-contained page (inline CSS, base64 PNG plots), readable offline, from the report dict."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from . import plots
from .report_md import COLUMNS, fmt, summary_row

OPEN_LAYERS = 12  # per-layer tables of deeper models start collapsed
SECTIONS = ("verdict", "summary", "per-layer", "logits", "perplexity", "greedy", "gate", "setup")

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1320px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:.6em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td{white-space:nowrap}
th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}.bad{background:#fdd}.ok{background:#dfd}
.text td,.text th{text-align:left}.text td{white-space:pre-wrap}summary{cursor:pointer;color:#345}code{background:#f4f4f4;padding:0 3px}img{max-width:100%;height:auto}
h2{border-bottom:1px solid #ddd;margin-top:1.6em}.plots{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
#verdict p{background:#f6f8ff;border-left:4px solid #4a6fd8;padding:.7em 1em;font-size:1.05em;line-height:1.5;max-width:80em}
#verdict code{display:block;margin:.4em 0;padding:.3em .6em;word-break:break-all;background:#e8ecf8}
"""

def _table(header: Sequence[str], rows: list[list[str]], marks: list[str] | None = None, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for n, row in enumerate(rows):
        mark = f' class="{marks[n]}"' if marks and marks[n] else ""  # the row's, not the table's `cls`
        body.append(f"<tr{mark}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><tr>{head}</tr>{''.join(body)}</table>"


def _img(b64: str, alt: str) -> str:
    return f'<img src="data:image/png;base64,{b64}" alt="{html.escape(alt)}">'


def _verdict(report: dict[str, Any]) -> str:
    """The verdict paragraph (verdict.py), `code` spans as <code>."""
    verdict = report.get("verdict")
    if verdict is None:
        return "<p>No verdict (report written without one).</p>"
    parts = html.escape(verdict["text"]).split("`")
    return "<p>" + "".join(f"<code>{p}</code>" if n % 2 else p for n, p in enumerate(parts)) + "</p>"


def _section(key: str, title: str, body: str) -> str:
    return f'<section id="{key}"><h2>{html.escape(title)}</h2>{body}</section>'


def _errors_cells(errs: dict[str, float] | None) -> list[str]:
    if errs is None:
        return ["-"] * 4
    return [fmt(errs["cosine"], ".7f"), fmt(errs["max_abs"], ".3g"), fmt(errs["rel_rms"], ".3g"),
            fmt(errs["snr_db"], ".1f")]


def _per_layer(report: dict[str, Any]) -> str:
    settings = report["settings"]
    parts = [
        f"<p>Hidden state after each decoder layer and the K/V rows each layer writes, on the same "
        f"{report['text']['n_tokens']} tokens; the export runs on its own outputs (errors accumulate). "
        f"A layer's error is the largest relative RMS error of its hidden/K/V. <b>First drift layer</b>: the "
        f"first layer whose error exceeds both {settings['jump_floor']:g} and {settings['jump_factor']:g} x the "
        f"median of the errors before it (the embedding output's error counting as one; 0 when unknown). "
        f"<b>Largest jump</b>: the layer with the largest error / max(previous error, floor). Plots: hidden "
        f"states solid (the embedding output at 'embed'), K/V dashed (the worse of the two); exact matches "
        f"(zero error) are not drawn.</p>",
        _img(plots.layer_error_png(report["variants"]), "per-layer error curves"),
    ]
    for v in report["variants"]:
        pl = v["per_layer"]
        header = ["layer"] + [f"{kind} {m}" for kind in ("hidden", "K", "V") for m in ("cos", "max|Δ|", "relRMS", "SNR dB")]
        rows, marks = [], []
        if pl["embed"] is not None:
            rows.append(["embed"] + _errors_cells(pl["embed"]) + ["-"] * 8)
            marks.append("")
        for entry in pl["layers"]:
            rows.append([str(entry["layer"])] + _errors_cells(entry["hidden"]) + _errors_cells(entry["key"])
                        + _errors_cells(entry["value"]))
            marks.append("bad" if entry["layer"] == pl["first_drift_layer"] else "")
        drift = pl["first_drift_layer"]
        jump = pl["largest_jump_layer"]
        shut = len(pl["layers"]) > OPEN_LAYERS  # deep models: the table is one click away, the plot is the overview
        parts.append(f"<h3>{html.escape(v['name'])}</h3><p>{html.escape(pl['note'])} First drift layer: "
                     f"<b>{'none' if drift is None else drift}</b>; largest jump: "
                     f"<b>{'none' if jump is None else jump}</b>.</p>"
                     f"<details{'' if shut else ' open'}><summary>{len(pl['layers'])} layers: every error</summary>"
                     + _table(header, rows, marks, "num") + "</details>")
    return "".join(parts)


def _logits(report: dict[str, Any]) -> str:
    header = ["variant", "positions", "KL mean", "KL median", "KL p90", "KL p95", "KL p99", "KL max",
              "top-1", "top-5 overlap", "Δp mean", "Δp RMS", "Δp worst", "max |Δlogit|"]
    rows = []
    for v in report["variants"]:
        lg = v["logits"]
        kl = lg["kl"]
        rows.append([v["name"], str(lg["n_positions"])] + [fmt(kl[k], ".3g") for k in
                     ("mean", "median", "p90", "p95", "p99", "max")]
                    + [f"{fmt(100 * lg['top1'], '.2f')} %", f"{fmt(100 * lg['top5'], '.2f')} %"]
                    + [fmt(lg["dp"][k], "+.3g") for k in ("mean", "rms", "worst")] + [fmt(lg["max_abs_logit"], ".3g")])
    intro = ("<p>Per position of the evaluation text (teacher-forced through the prefill graphs; the decode "
             "graphs are exercised by the greedy continuations below): KL(PyTorch || export) of the next-token "
             "distributions, whether the argmax agrees (top-1), the overlap of the top-5 sets, and Δp = the "
             "probability the export gives PyTorch's top token minus PyTorch's own (worst = most negative).</p>")
    hists = "".join(_img(plots.kl_histogram_png(v), f"KL histogram {v['name']}") for v in report["variants"])
    return intro + _table(header, rows) + f'<div class="plots">{hists}</div>'


def _perplexity(report: dict[str, Any]) -> str:
    rows = [[v["name"], fmt(v["ppl"]["ref_ppl"], ".5g"), fmt(v["ppl"]["ppl"], ".5g"), fmt(v["ppl"]["delta"], "+.4g"),
             f"{fmt(100 * v['ppl']['delta_rel'], '+.3f')} %"] for v in report["variants"]]
    return ("<p>Perplexity on the evaluation text (each logit row scores the next token).</p>"
            + _table(["variant", "PyTorch PPL", "export PPL", "ΔPPL", "ΔPPL relative"], rows))


def _greedy(report: dict[str, Any]) -> str:
    s = report["settings"]
    parts = [f"<p>{s['prompts']} prompts of {s['prompt_len']} tokens sliced from the text; each continues "
             f"greedily for up to {s['continuation']} tokens (stopping at EOS). <i>agree</i> counts the tokens "
             f"the export generates identically before the first divergence from PyTorch.</p>"]
    for v in report["variants"]:
        g = v["greedy"]
        with_text = all("reference_text" in p for p in g["prompts"]) and g["prompts"]
        rows = []
        for p in g["prompts"]:
            shown = p["agree"] + 3  # ids up to the divergence and a little after
            row = [str(p["start"]), f"{p['agree']}/{len(p['reference'])}"]
            if with_text:
                row += [p["prompt_text"], p["reference_text"], p["export_text"]]
            else:
                row += [" ".join(map(str, p["reference"][:shown])), " ".join(map(str, p["export"][:shown]))]
            rows.append(row)
        header = ["start", "agree"] + (["prompt", "PyTorch continuation", "export continuation"] if with_text
                                       else ["PyTorch ids (to divergence + 3)", "export ids"])
        marks = ["ok" if p["agree"] == len(p["reference"]) else "bad" for p in g["prompts"]]
        parts.append(f"<h3>{html.escape(v['name'])}: {g['agreed']}/{g['total']} tokens agree, "
                     f"{g['identical']}/{len(g['prompts'])} continuations identical</h3>"
                     + _table(header, rows, marks, "text"))
    return "".join(parts)


def _gate(report: dict[str, Any]) -> str:
    gate = report.get("gate")
    if gate is None:
        return "<p>No <code>--fail-if</code> gate was given.</p>"
    verdict = "passed" if gate["passed"] else "FAILED"
    rows = [[f["variant"], f["condition"], fmt(f["value"], ".4g")] for f in gate["failed"]]
    return (f"<p>Gate <code>{html.escape(', '.join(gate['conditions']))}</code>: <b>{verdict}</b>.</p>"
            + (_table(["variant", "fail if", "value"], rows, ["bad"] * len(rows)) if rows else ""))


def _setup(report: dict[str, Any]) -> str:
    t = report["text"]
    source = f"file {t['path']}" if t["source"] == "file" else f"generated by PyTorch (seed {t['seed']}, temperature 1)"
    rows = [["checkpoint", f"{report['checkpoint']['path']} ({report['checkpoint']['source']})"],
            ["evaluation text", source], ["tokens", str(t["n_tokens"])],
            ["first token (BOS)", "none (no BOS)" if t["start_id"] is None else str(t["start_id"])],
            ["edgellm", report["edgellm_version"]], ["created", report["created"]],
            ["run time", f"{report['seconds']:.1f} s"]]
    rows += [[f"export {v['name']}", f"{v['path']} ({v['precision']}, {v['granularity']}, max_seq {v['max_seq']}, "
              f"prefill_chunk {v['prefill_chunk']}, {v['seconds']:.1f} s)"] for v in report["variants"]]
    return _table(["", ""], rows, cls="text")


def render_html(report: dict[str, Any]) -> str:
    """The whole page; every section id in SECTIONS appears exactly once."""
    variants = report["variants"]
    failed = {f["variant"] for f in (report.get("gate") or {}).get("failed", [])}
    summary = _table(COLUMNS, [summary_row(v) for v in variants], ["bad" if v["name"] in failed else "" for v in variants])
    body = "".join([
        _section("verdict", "Verdict", _verdict(report)),
        _section("summary", "Summary", summary),
        _section("per-layer", "Per-layer errors", _per_layer(report)),
        _section("logits", "Logits (KL, top-1, top-5, Δp)", _logits(report)),
        _section("perplexity", "Perplexity", _perplexity(report)),
        _section("greedy", "Greedy continuation agreement", _greedy(report)),
        _section("gate", "Gate (--fail-if)", _gate(report)),
        _section("setup", "Setup", _setup(report)),
    ])
    title = f"edgellm diff: {', '.join(v['name'] for v in variants)}"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")
