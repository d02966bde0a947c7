"""`--block-min auto`: whether an export's 4-bit linears already lie on Q4_1's grid, and then keep it exactly.

A model converted from a llama.cpp Q4_1 GGUF holds, in every 32-weight block of every linear, values `m + q * d`
(q = 0..15, d and m fp16): a 4-bit grid with a float offset. Rounding such weights again onto a symmetric grid,
or AWQ's scaled one, adds a second rounding error on top of the first (SmolLM2-135M-Instruct, whose only copy
here is a Q4_1 GGUF: KL 0.22 to its fp32 weights with the --bits 4 default); blocks with offsets
(schemes.Scheme.offsets) give them back exactly. So `auto` turns them on, rounded to nearest, when every linear
the plan makes 4-bit lies on that grid at its block size, and off otherwise (the first weight off it ends the
scan: a trained float weight is ~a quarter step off in most blocks). Q4_0's symmetric grid needs nothing of the
kind: AWQ's own search keeps it (scale migration 0 and clip ratio 1 give error 0; llama.cpp's Q4_0 GGUF of
SmolLM2: all 120 linears back exactly, docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from edgellm.runtime.fileio import safe_join
from edgellm.runtime.manifest import Manifest

from .onnxedit import load_graph
from .options import QuantizeOptions
from .schemes import on_grid
from .sites import matmul_weights


def all_on_grid(src: Path, manifest: Manifest, options: QuantizeOptions) -> int:
    """How many 4-bit linears `options` would make, if every one lies on its scheme's grid; 0 at the first that
    does not (or when there is none)."""
    choose = options.chooser(manifest.n_layers)
    checked = 0
    for g in manifest.graphs:
        if g.role != "layer" or g.seq != manifest.prefill_chunk:
            continue
        for site, w in matmul_weights(load_graph(safe_join(src, g.file), True).graph):
            spec = choose(site)
            if spec is None or spec.scheme.bits != 4:
                continue
            if spec.scheme.block_size == 0 or not on_grid(w, spec.scheme):
                return 0
            checked += 1
    return checked


def resolve(src: Path, manifest: Manifest, options: QuantizeOptions,
            log: Callable[[str], None]) -> QuantizeOptions:
    """`options` with `block_min` "auto" made "on" (and --method rtn) or "off"; other values as they are."""
    if options.block_min != "auto":
        return options
    if options.bits != 4 or options.format != "fast" or not options.symmetric or options.group == 0:
        return dataclasses.replace(options, block_min="off")
    found = dataclasses.replace(options, block_min="on", method="rtn")
    checked = all_on_grid(src, manifest, found)
    if not checked:
        return dataclasses.replace(options, block_min="off")
    log(f"--block-min auto: all {checked} 4-bit linears lie on Q4_1's {options.group}-weight grid (as a model "
        f"converted from a Q4_1 GGUF does): kept exactly, in blocks with offsets, rounded to nearest"
        + (f" (not --method {options.method}, which would move them off it)" if options.method != "rtn" else "")
        + "; --block-min off decodes ~1.3x faster, at a second rounding's error")
    return found
