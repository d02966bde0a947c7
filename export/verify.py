"""Export-time verification: every graph in onnxruntime against the Decoder on seeded inputs.

Inputs include a non-empty cache of random rows (the rows past `past_len` must be masked out, so they are
random too) and positions that start at `past_len`, not 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from .graphs import Reference


def session(path: Path) -> ort.InferenceSession:
    """A CPU session with default (full) graph optimisation, as the runtime creates it."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def max_abs_diff(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest error over all outputs, each output's max |got - want| divided by max(1, max |want|).

    An absolute error for outputs of unit scale, a relative one for larger outputs: float32 rounding grows
    with the values, and a trained layer fed the N(0,1) verification inputs can output |h| ~ 500 (a 3.4M
    qwen3 demo model: 2.1e-4 absolute = 4e-7 relative, which a plain absolute 1e-4 refused).
    inf when a shape differs or anything is not finite.
    """
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            return math.inf
        w64 = w.astype(np.float64)
        d = np.abs(g.astype(np.float64) - w64)
        if not np.isfinite(d).all():
            return math.inf
        if d.size:
            worst = max(worst, float(d.max()) / max(1.0, float(np.abs(w64).max())))
    return worst


def verify_graph(path: Path, reference: Reference, inputs: dict[str, Tensor], output_names: list[str],
                 in_place: bool = False) -> float:
    """Run the .onnx file and the PyTorch reference on the same inputs; the max abs difference.

    `in_place` (kv_layout "inplace"): each present_* output is bound to its past_* input's buffer, as the
    runtime binds them, so what is compared is the cache after the graph wrote into it - rows outside
    [past_len, past_len + S) included, which must come out untouched.
    """
    sess = session(path)
    # the graph's own input types: an fp16 cache (manifest kv_dtype) is fed fp16 (example_inputs rounded its
    # values to fp16 already, so the reference reads the same rows)
    types = {i.name: np.float16 if i.type == "tensor(float16)" else None for i in sess.get_inputs()}
    feeds = {k: v.numpy().astype(types[k]) if types.get(k) else v.numpy().copy() for k, v in inputs.items()}
    if in_place:
        binding = sess.io_binding()
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        got = []
        for name, spec in zip(output_names, sess.get_outputs(), strict=True):
            array = feeds.get(name.replace("present_", "past_"), np.zeros(spec.shape, np.float32))
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
            got.append(array)
        sess.run_with_iobinding(binding)
    else:
        got = sess.run(output_names, feeds)
    with torch.no_grad():
        want = [t.numpy() for t in reference(inputs)]
    return max_abs_diff(got, want)


def verification_past_len(max_seq: int, seq: int, gen: torch.Generator) -> int:
    """A random filled length in [1, max_seq - seq] (0 only when a chunk fills the whole context)."""
    room = max_seq - seq
    return int(torch.randint(1, room + 1, (1,), generator=gen)) if room >= 1 else 0
