"""`--int8-fraction F`: mixed precision by measured sensitivity, in the spirit of llama.cpp's k-quant mixes
(Q4_K_M gives attn_v and ffn_down of some layers more bits), but with the choice measured, not listed.

Sensitivity of a linear W [N, K] on the calibration data (H = X^T X, calibrate.py):
    rel(W, Wq) = ||X (W - Wq)^T||^2 / ||X W^T||^2 = tr(D H D^T) / tr(W H W^T),   D = W - Wq
the layer's output noise-to-signal ratio under the plan's int4 scheme (RTN, the cheap stand-in for any
method) minus that under int8. Promoting W to int8 removes that much relative noise from the layer's output
at a cost of its extra bytes, so weights are promoted greedily by gain per extra byte (the knapsack's
greedy order) until their parameters reach F of all int4 linears' parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgellm.runtime.fileio import safe_join
from edgellm.runtime.graphio import STACK_ROLES
from edgellm.runtime.manifest import Manifest

from .plan import WeightSite
from .runner import weight_inputs
from .schemes import Scheme, dequantize, quantize


@dataclass(frozen=True)
class Sensitivity:
    name: str                  # weight initializer
    params: int
    rel4: float                # output noise-to-signal ratio at the int4 scheme
    rel8: float                # ... at int8

    @property
    def gain_per_param(self) -> float:
        return (self.rel4 - self.rel8) / max(self.params, 1)


def relative_output_error(w: np.ndarray, scheme: Scheme, h: np.ndarray) -> float:
    """tr(D H D^T) / tr(W H W^T) for D = W - RTN(W) (w canonical [N, K], h [K, K])."""
    d = (w - dequantize(quantize(w, scheme))).astype(np.float64)
    h64 = np.asarray(h, np.float64)
    signal = float(np.sum((w.astype(np.float64) @ h64) * w))
    return float(np.sum((d @ h64) * d)) / signal if signal > 0 else 0.0


def measure(src: Path, manifest: Manifest, hessians: Mapping[str, np.ndarray], low: Scheme, high: Scheme,
            eligible: Callable[[WeightSite], bool], progress: Callable[[], None] | None = None) -> list[Sensitivity]:
    """The sensitivity of every eligible weight matmul of the fp32 export with a Hessian."""
    found: dict[str, Sensitivity] = {}
    for g in manifest.graphs:
        if g.seq != manifest.prefill_chunk or g.role in STACK_ROLES:
            continue
        model = onnx.load(str(safe_join(src, g.file)), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        for name in weight_inputs(model.graph):
            if name in found or name not in hessians:
                continue
            t = inits[name]
            shape = (int(t.dims[1]), int(t.dims[0]))                        # MatMul B [K, N] -> [N, K]
            if not eligible(WeightSite(name, "MatMul", "", name.removesuffix(".weight"), shape)):
                continue
            onnx.external_data_helper.load_external_data_for_tensor(t, str(src))
            w = np.ascontiguousarray(numpy_helper.to_array(t).T, np.float32)
            h = hessians[name]
            found[name] = Sensitivity(name, w.size, relative_output_error(w, low, h),
                                      relative_output_error(w, high, h))
        if progress is not None:
            progress()
    return list(found.values())


def choose(sensitivities: list[Sensitivity], fraction: float) -> frozenset[str]:
    """Greedy by gain per parameter until the promoted parameters reach `fraction` of all of them."""
    total = sum(s.params for s in sensitivities)
    chosen, used = [], 0
    for s in sorted(sensitivities, key=lambda s: -s.gain_per_param):
        if used + s.params > fraction * total + 0.5 * s.params:     # nearest to the target, not always under
            continue
        chosen.append(s.name)
        used += s.params
    return frozenset(chosen)
