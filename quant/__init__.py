"""edgellm.quant: weight-only int8/int4 quantization of exported ONNX graphs (onnx + numpy; onnxruntime
for calibration and checks).

    schemes.py     integer codes, (de)quantization, error
    packing.py     the MatMulNBits and DequantizeLinear packings of a quantized weight
    methods.py     how scales are chosen: rtn, mse (optionally activation-weighted)
    gptq.py        GPTQ's error-compensating rounding against a calibration Hessian (--method gptq)
    mixed.py       --int8-fraction: which linears get int8, by measured output-error sensitivity
    budget.py      --kl-budget: the smallest variant of a size ladder within a measured KL
    plan.py        QuantPlan: which weight gets which spec, memoised quantization
    rewrite.py     one ModelProto: MatMul/Gemm -> MatMulNBits | DequantizeLinear+MatMul, Gather -> int8 rows
    tied.py        the tied embedding lookup, sharing the lm_head's quantized table (any bits / block)
    options.py     `edgellm quantize` flags -> QuantPlan
    calibrate.py   activation scales and Hessians from the fp32 export itself
    runner.py      logits and weight inputs through the runtime's Engine (its hook feeds probe graphs)
    onnxedit.py    names in use, dead initializers, opset imports
    storage.py     external data files, each tensor stored once
    export_dir.py  quantize_export: an export directory -> a new quantized one
    report.py      the per-weight table, KL / top-1 (runtime/metrics.py)

Names are imported on first use, so `import edgellm.quant` does not load onnx.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "quantize_export": "export_dir", "QuantizeResult": "export_dir", "QuantizeOptions": "options",
    "QuantPlan": "plan", "WeightSite": "plan", "WeightReport": "plan", "by_pattern": "plan",
    "QuantSpec": "methods", "quantize_weight": "methods", "Scheme": "schemes", "quantize_model": "rewrite",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
