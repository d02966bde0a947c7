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


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


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
    """Two panels vs layer: relative RMS error (log) and SNR (dB); hidden solid, K/V (max of both) dashed."""
    fig, (ax_rel, ax_snr) = plt.subplots(1, 2, figsize=(11, 3.8))
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
            ax_rel.plot(xs, _clip(rel, _TINY, 1e6), style, color=color, label=label, ms=4)
            ax_snr.plot(xs, _clip(snr, -50, 400), style, color=color, label=label, ms=4)
        drift = v["per_layer"]["first_drift_layer"]
        if drift is not None:
            ax_rel.axvline(drift, color=color, alpha=0.35, lw=3)
    ax_rel.set_yscale("log")
    ax_rel.set_title("relative RMS error (shaded: first drift layer)", fontsize=10)
    ax_snr.set_title("SNR in dB (higher is better)", fontsize=10)
    n_layers = max(len(v["per_layer"]["layers"]) for v in variants)
    with_embed = any(v["per_layer"]["embed"] is not None for v in variants)
    ticks = list(range(-1 if with_embed else 0, n_layers))
    step = max(1, len(ticks) // 16)  # at most ~16 labels for deep models
    for ax in (ax_rel, ax_snr):
        ax.set_xlabel("decoder layer")
        ax.grid(alpha=0.3)
        ax.set_xticks(ticks[::step], ["embed" if t == -1 else str(t) for t in ticks[::step]])
    ax_rel.legend(fontsize=7)
    return _png(fig)


def kl_histogram_png(variant: dict[str, Any]) -> str:
    """Histogram of the per-position KL(PyTorch || export) on log-spaced bins, mean and p99 marked."""
    kl = np.asarray(variant["logits"]["kl_per_position"], np.float64)
    kl = np.where(np.isfinite(kl), kl, 1e3)
    shown = np.clip(kl, _TINY, None)
    lo, hi = math.floor(math.log10(shown.min())), math.ceil(math.log10(shown.max()))
    bins = np.logspace(lo, max(hi, lo + 1), 40)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.hist(shown, bins=bins, color=_COLORS[0], alpha=0.8)
    ax.set_xscale("log")
    stats = variant["logits"]["kl"]
    for key, style in (("mean", "-"), ("p99", "--")):
        if math.isfinite(stats[key]):
            ax.axvline(max(stats[key], _TINY), color="k", ls=style, lw=1, label=f"{key} {stats[key]:.3g}")
    ax.set_title(f"{variant['name']}: KL per position ({len(kl)} positions)")
    ax.set_xlabel("KL (nats, exact zeros drawn at 1e-12)")
    ax.set_ylabel("positions")
    ax.legend(fontsize=7)
    return _png(fig)
