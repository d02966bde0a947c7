"""What a quantized export records about itself: its logits checked against the fp32 export's (and its stack graphs
against the layer graphs they were built from), and the manifest's `quantization` object."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgellm import __version__
from edgellm.layout.stacking import check_lone, check_stack
from edgellm.runtime.errors import need
from edgellm.runtime.fileio import sha256_file
from edgellm.runtime.manifest import MANIFEST, Manifest

from . import kv_int8
from .calibrate import Calibration, sample_sequences
from .options import QuantizeOptions
from .plan import QuantPlan, WeightReport, WeightSite
from .report import LogitComparison, compare_logits
from .runner import export_logits

RECORD_VERSION = 1        # of the manifest's `quantization` object
CHECK_TOKENS = 128        # positions compared against fp32 after quantizing (one sampled sequence)


def site(r: WeightReport) -> WeightSite:
    return WeightSite(r.name, r.op, "", r.module, r.shape)


def kv_cache_record(scales: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """The int8 cache's calibration in the record: its rule and each layer's largest key / value scale."""
    return {"dtype": "int8", "scales": "static, symmetric, per (kv head, channel)", "margin": kv_int8.MARGIN,
            "max_scale": [[float(f"{k.max():.6g}"), float(f"{v.max():.6g}")] for k, v in scales]}


def check_export(src: Path, src_manifest: Manifest, tmp: Path, new: Manifest,
                 seed: int) -> tuple[LogitComparison, dict[str, float]]:
    """fp32 vs quantized logits on one sequence the fp32 export samples (another seed than calibration); and
    the stack graph (if any) vs the layer graphs it was built from, the lone-row stack (if any) vs the stack,
    through the runtime's Engine (the manifest's `verification` keys)."""
    (tokens,) = sample_sequences(src, min(CHECK_TOKENS, src_manifest.max_seq) - 1, seed + 1_000_003)
    (ref,) = export_logits(src, src_manifest, [tokens])
    (got,) = export_logits(tmp, new, [tokens])
    comparison = compare_logits([ref], [got])
    need(comparison.max_abs_diff < float("inf"), f"{tmp}: the quantized export produces non-finite logits")
    checks = {"stack_vs_layers": check_stack(tmp, new, tokens)} if new.has_stack else {}
    if new.has_lone_stack:
        checks["lone_vs_stack"] = check_lone(tmp, new, tokens)
    return comparison, checks


def quantization_record(options: QuantizeOptions, plan: QuantPlan, names: list[tuple[str, WeightReport]],
            calib: Calibration | None, comparison: LogitComparison | None, src_manifest: Manifest,
            src: Path, alpha: dict[str, float], kv_scales: list | None = None) -> dict:
    """The manifest's `quantization` object (version RECORD_VERSION)."""
    weights = {}
    for name, r in names:
        spec = plan.choose(site(r))
        entry: dict = {"initializer": r.name, "op": r.op, "shape": list(r.shape),
                       "bytes_before": r.bytes_before, "bytes_after": r.bytes_after}
        if spec is None or r.scheme == "fp32":
            entry |= {"bits": 32, "block_size": 0, "symmetric": None, "method": None, "format": "fp32",
                      "max_abs_err": 0.0, "rel_rms_err": 0.0}
        else:
            entry |= {"bits": spec.scheme.bits, "block_size": spec.scheme.block_size,
                      "symmetric": spec.scheme.symmetric, "method": r.scheme.rsplit("-", 1)[-1],
                      "format": options.format, "offsets": spec.scheme.offsets,
                      "max_abs_err": float(f"{r.max_abs_err:.6g}"),
                      "rel_rms_err": float(f"{r.rel_rms_err:.6g}")}
        if r.shared_with:
            entry["shared_with"] = r.shared_with
        if r.op != "Gather" and r.name in alpha:
            entry["awq_alpha"] = alpha[r.name]      # 0: AWQ's search kept the unscaled weight
        weights[name] = entry
    before = sum(r.bytes_before for _, r in names if not r.shared_with)
    after = sum(r.bytes_after for _, r in names)
    return {"version": RECORD_VERSION, "tool": f"edgellm quantize {__version__}", "options": options.to_dict(),
            "accuracy_level": options.accuracy_level if options.format == "fast" else None,
            "source": {"preset": src_manifest.preset, "manifest_sha256": sha256_file(src / MANIFEST)},
            "calibration": calib.to_dict() if calib else None,
            "weight_bytes": {"before": before, "after": after},
            **({"kv_cache": kv_cache_record(kv_scales)} if kv_scales else {}),
            "check": comparison.to_dict() if comparison else None,
            "weights": weights}
