"""`quantize --kv-dtype int8`: an int8 KV cache, a quarter of the fp32 cache's bytes.

onnxruntime's CPU GroupQueryAttention (>= 1.27; 1.25-1.26 fail with packed q/k/v) keeps its cache as int8 when
given static symmetric scales: it writes round(x / scale) clipped to [-128, 127] for each new K / V row and reads
code * scale back, attention itself in fp32. The scales are per (kv head, channel), [n_kv, 1, head_dim] per layer (PER_CHANNEL: keys have a few
channels an order of magnitude larger than the rest, which one scale per tensor would crush): the largest |value|
each channel took over calibration text, run through the fp32 export (keys as cached: after RoPE), times MARGIN,
over 127. A value past the calibrated range is clipped, so the margin buys headroom with resolution.

MARGIN, measured on SmolLM2-135M-Instruct (fp32 weights, an int8 cache simulated on the runtime's buffers, mean KL
vs the fp32 cache teacher-forced on GPL-3's first 512 ids): scales from quantize's default calibration (512 tokens the
export samples from BOS, 4 sequences of 128) x1.4 0.0070, x2.0 0.0035, x3.0 0.0072; from 512 tokens of an English
text (python's email/architecture.rst) x1.4 0.0019, x2.0 0.0038 (256 ids: per tensor 0.0082, per channel x1.0 0.0126,
x1.2 0.0047). Sampled text stays in a narrower range than real text, which x1.4 then clips; x2.0 holds for both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from tqdm import tqdm

from edgellm.runtime.engine import Engine
from edgellm.runtime.errors import need
from edgellm.runtime.manifest import Manifest

from .calibrate import Calibration, sample_sequences, text_sequences
from .options import QuantizeOptions

MARGIN = 2.0
FLOOR = 1e-3     # a channel never seen non-zero still gets this fraction of its layer's largest scale
SCALE_NAMES = ("k_cache_scale", "v_cache_scale")
SCALE_INPUT = 12  # GroupQueryAttention's k_scale (v_scale 13): inputs 9-11 (positions, bias, sinks) stay empty


def calibrated(src: Path, manifest: Manifest, options: QuantizeOptions, progress: bool,
               calib: Calibration | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """`--kv-dtype int8`: each layer's cache scales, from the fp32 export's K/V on the calibration text: the
    sequences the weights were calibrated on (`calib`), else the same rule's (sampled by the export, or the
    --calibration-text), so a sampled text is not generated twice."""
    if calib is not None and calib.ids:
        sequences: Sequence[Sequence[int]] = calib.ids
    elif options.calibration_text is not None:
        sequences = text_sequences(src, options.calibration_text, options.calibration_tokens)
    else:
        sequences = sample_sequences(src, options.calibration_tokens, options.seed)
    with tqdm(total=sum(map(len, sequences)), desc="kv ranges", unit="tok", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        return cache_scales(src, manifest, sequences, bar.update)


def cache_scales(directory: Path, manifest: Manifest, sequences: Sequence[Sequence[int]],
                 progress: Callable[[int], None] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (k_scale, v_scale), each [n_kv, 1, head_dim] float32: the largest |row| of each channel over the
    sequences (each from an empty cache, as the export's runtime fills it), x MARGIN / 127."""
    engine = Engine.open(Path(directory), manifest)
    cache = engine.cache
    n = manifest.n_layers
    peaks = [[np.zeros(cache.keys[i].shape[1::2], np.float32) for i in range(n)] for _ in range(2)]  # [n_kv, hd]
    for seq in sequences:
        cache.reset()
        engine.forward_rows(seq)
        for i in range(n):
            for peak, buf in zip(peaks, (cache.keys[i], cache.values[i]), strict=True):
                np.maximum(peak[i], np.abs(buf[0, :, :cache.length]).max(axis=1), out=peak[i])
        if progress is not None:
            progress(len(seq))
    out = []
    for i in range(n):
        pair = []
        for peak in (peaks[0][i], peaks[1][i]):
            need(np.isfinite(peak).all() and peak.max() > 0, f"layer {i}: calibration saw no finite K/V values")
            scale = np.maximum(peak, FLOOR * peak.max()) * np.float32(MARGIN / 127)
            pair.append(scale[:, None, :].astype(np.float32))
        out.append((pair[0], pair[1]))
    return out


def int8_cache(model: onnx.ModelProto, scales: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Give every GroupQueryAttention of `model` its layer's int8 cache: the scale initializers, the quantization
    attributes, past_* / present_* typed int8. Returns the nodes changed."""
    graph = model.graph
    have = {t.name for t in graph.initializer}
    changed = 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        layer = int(node.input[3].rsplit(".", 1)[1])  # past_key.{i}
        names = [f"layers.{layer}.attn.{s}" for s in SCALE_NAMES]
        for name, scale in zip(names, scales[layer], strict=True):
            if name not in have:  # a paired or stacked graph: one copy per layer
                graph.initializer.append(numpy_helper.from_array(scale, name))
                have.add(name)
        node.input.extend([""] * (SCALE_INPUT - len(node.input)) + names)
        node.attribute.extend([helper.make_attribute("kv_cache_bit_width", 8),
                               helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL")])
        changed += 1
    for value in (*graph.input, *graph.output):
        if value.name.startswith(("past_key.", "past_value.", "present_key.", "present_value.")):
            value.type.tensor_type.elem_type = onnx.TensorProto.INT8
    return changed
