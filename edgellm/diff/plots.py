"""The report's figures as base64 PNG strings (matplotlib Agg: no display, no files), drawn from the report dict."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless CI box or a board over ssh has no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

_TINY = 1e-12  # log axes cannot show 0: exact matches are drawn at this value
_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


DPI = 100          # the page shows images at their natural size up to ~1300 px (report_html's max width)
_LABEL_IN = 0.30   # inches one tick label needs along x (a 2-digit layer at fontsize 9 plus a gap; "embed" fits)


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def layer_figure_width(n_ticks: int) -> float:
    """Inches of the per-layer axes: 0.28 in per layer, between 7 (a 2-layer model) and 11 (wide enough for
    ~30 labelled layers; with the legend beside it the PNG stays under ~1300 px, the page's width)."""
    return min(max(3.0 + 0.28 * n_ticks, 7.0), 11.0)


def tick_step(n_ticks: int, axes_inches: float) -> int:
    """Label every `step`-th layer so labels never touch: 1, 2, 5, 10, 20, 50 ... layers apart."""
    room = max(int(axes_inches / _LABEL_IN), 2)
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        if math.ceil(n_ticks / step) <= room:
            return step
    return 1000


def _series(layers: list[dict[str, Any]], kind: str, metric: str) -> tuple[list[int], list[float]]:
    """(layer indices, values) of one tensor kind ("hidden", "key", "value") and metric, skipping gaps."""
    xs, ys = [], []
    for entry in layers:
        errs = entry.get(kind)
        if errs is not None:
            xs.append(entry["layer"])
            ys.append(errs[metric])
    return xs, ys


def _clip(values: list[float], lo: float, hi: float) -> list[float]:
    return [min(max(v, lo), hi) if not math.isnan(v) else hi for v in values]


def layer_error_png(variants: list[dict[str, Any]]) -> str:
    """Two stacked panels vs layer: relative RMS error (log) and SNR (dB); hidden solid, K/V (worse of the two)
    dashed. The width grows with the layer count, labels are thinned to fit, the legend sits outside."""
    n_layers = max(len(v["per_layer"]["layers"]) for v in variants)
    with_embed = any(v["per_layer"]["embed"] is not None for v in variants)
    first = -1 if with_embed else 0
    width = layer_figure_width(n_layers - first)
    fig, (ax_rel, ax_snr) = plt.subplots(2, 1, figsize=(width + 2.2, 6.4), sharex=True, layout="constrained")
    for n, v in enumerate(variants):
        color = _COLORS[n % len(_COLORS)]
        layers = v["per_layer"]["layers"]
        for kind, style in (("hidden", "-o"), ("kv", "--s")):
            if kind == "kv":
                xs, k_rel = _series(layers, "key", "rel_rms")
                _, v_rel = _series(layers, "value", "rel_rms")
                _, k_snr = _series(layers, "key", "snr_db")
                _, v_snr = _series(layers, "value", "snr_db")
                rel = [max(a, b) for a, b in zip(k_rel, v_rel, strict=True)]
                snr = [min(a, b) for a, b in zip(k_snr, v_snr, strict=True)]
            else:
                xs, rel = _series(layers, "hidden", "rel_rms")
                _, snr = _series(layers, "hidden", "snr_db")
                embed = v["per_layer"]["embed"]
                if embed is not None:  # the embedding output, drawn at x = -1: the error the layers start from
                    xs, rel, snr = [-1, *xs], [embed["rel_rms"], *rel], [embed["snr_db"], *snr]
            exact = [r == 0.0 for r in rel]  # exact matches have no place on a log axis: left out
            xs, rel, snr = ([a for a, e in zip(seq, exact, strict=True) if not e] for seq in (xs, rel, snr))
            if not xs:
                continue
            label = f"{v['name']} {'hidden' if kind == 'hidden' else 'K/V'}"
            ms = 4 if n_layers <= 40 else 2
            ax_rel.plot(xs, _clip(rel, _TINY, 1e6), style, color=color, label=label, ms=ms)
            ax_snr.plot(xs, _clip(snr, -50, 400), style, color=color, label=label, ms=ms)
        drift = v["per_layer"]["first_drift_layer"]
        if drift is not None:
            for ax in (ax_rel, ax_snr):
                ax.axvline(drift, color=color, alpha=0.3, lw=4)
    ax_rel.set_yscale("log")
    ax_rel.set_title("relative RMS error per layer (lower is better; shaded: first drift layer)", fontsize=11)
    ax_snr.set_title("SNR in dB (higher is better)", fontsize=11)
    step = tick_step(n_layers - first, width)
    labelled = ([-1] if with_embed else []) + list(range(0, n_layers, step))
    for ax in (ax_rel, ax_snr):
        ax.grid(alpha=0.3)
        ax.set_xlim(first - 0.6, n_layers - 0.4)
        ax.set_xticks(labelled, ["embed" if t == -1 else str(t) for t in labelled], fontsize=9)
        ax.set_xticks(range(first, n_layers), minor=True)  # every layer still has a tick mark
        ax.tick_params(axis="y", labelsize=9)
    ax_snr.set_xlabel("decoder layer")
    handles, labels = ax_rel.get_legend_handles_labels()
    if handles:  # beside the axes, never over the curves
        fig.legend(handles, labels, loc="outside right upper", fontsize=9, frameon=False)
    return _png(fig)


def kl_histogram_png(variant: dict[str, Any]) -> str:
    """Histogram of the per-position KL(PyTorch || export) on log-spaced bins, mean and p99 marked."""
    kl = np.asarray(variant["logits"]["kl_per_position"], np.float64)
    kl = np.where(np.isfinite(kl), kl, 1e3)
    shown = np.clip(kl, _TINY, None)
    lo, hi = math.floor(math.log10(shown.min())), math.ceil(math.log10(shown.max()))
    bins = np.logspace(lo, max(hi, lo + 1), 40)
    fig, ax = plt.subplots(figsize=(6.0, 3.4), layout="constrained")
    ax.hist(shown, bins=bins, color=_COLORS[0], alpha=0.8)
    ax.set_xscale("log")
    stats = variant["logits"]["kl"]
    for key, style in (("mean", "-"), ("p99", "--")):
        if math.isfinite(stats[key]):
            ax.axvline(max(stats[key], _TINY), color="k", ls=style, lw=1, label=f"{key} {stats[key]:.3g}")
    ax.set_title(f"{variant['name']}: KL per position ({len(kl)} positions)", fontsize=11)
    ax.set_xlabel("KL (nats, exact zeros drawn at 1e-12)")
    ax.set_ylabel("positions")
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside right upper", fontsize=9, frameon=False)
    return _png(fig)
