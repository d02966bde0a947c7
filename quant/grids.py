"""`--block-min auto`: whether an export's linears already lie on llama.cpp's grids, and then keep each exactly.

A model converted from a 4-bit llama.cpp GGUF holds, in every block of every linear, the values its blocks
dequantize to (quant/gridfit.py): Q4_0's symmetric 4-bit grid, Q4_1's or Q4_K's 4-bit grid with a float offset,
and, for the tensors a k-quant mix gave more bits (Q4_K_M: Q5_0, Q6_K, Q8_0), symmetric grids of up to 8 bits.
Rounding such weights again (AWQ's scaled grid, or any other) adds a second rounding error on top of the first:
SmolLM2-135M-Instruct, whose only copy here is a Q4_1 GGUF, KL 0.22 to its fp32 weights with AWQ; Gemma 3 270M
(a Q4_K_M GGUF: Q4_K, Q5_0, Q6_K and Q8_0 linears) 0.127. So `auto` keeps every linear the plan makes 4-bit on its
own grid when all of them lie on one and at least one on a 4-bit grid (the source was a 4-bit quantization;
weights all on 5-8 bit grids are quantized to 4 bits as asked): 4-bit grids in 4 bits (blocks with offsets where
they have one, schemes.Scheme.offsets), finer ones in int8 at the block size they fit (32, or Q6_K's 16), all with
the step (and offset) recovered exactly (`--method grid` in the record). A trained float weight lies on none:
the first such linear ends the scan, and the profile's settings for float weights stand (profiles.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from edgellm.runtime.fileio import safe_join
from edgellm.runtime.manifest import Manifest

from .gridfit import fit
from .methods import QuantSpec
from .onnxedit import load_graph
from .options import QuantizeOptions
from .plan import WeightSite
from .schemes import Scheme
from .sites import matmul_weights

FINER_BLOCKS = (16,)   # an int8 grid that does not fit the linears' block size: Q6_K's scales per 16 weights
SCAN_ROWS = 64         # rows of a weight the scan fits (spread over it); the rewrite fits them all, once


def own_scheme(w: np.ndarray, block: int) -> Scheme | None:
    """The scheme whose grid w [N, K] lies on, the fewest bits first (symmetric 4-bit, 4-bit with offsets,
    symmetric 8-bit at `block`, then at FINER_BLOCKS); None for a weight on no such grid.

    Judged on SCAN_ROWS rows spread over the weight: a GGUF tensor has one type, so its rows all lie on one
    grid, and a float weight lies on none in any row (plan.py fits every row when it stores the weight, and
    stops with an error should one be off). The whole weight would be fitted twice otherwise."""
    rows = w[np.linspace(0, len(w) - 1, min(len(w), SCAN_ROWS)).astype(np.int64)]
    candidates = [Scheme(4, block, True), Scheme(4, block, False, True), Scheme(8, block, True)]
    candidates += [Scheme(8, b, True) for b in FINER_BLOCKS if b < block]
    return next((s for s in candidates if fit(rows, s) is not None), None)


def _linears(src: Path, manifest: Manifest, options: QuantizeOptions) -> Iterator[tuple[WeightSite, np.ndarray, QuantSpec]]:
    """(site, w [N, K], its spec) of each layer linear the plan quantizes, in graph order (weights loaded lazily)."""
    choose = options.chooser(manifest.n_layers)
    for g in manifest.graphs:
        if g.role != "layer" or g.seq != manifest.prefill_chunk:
            continue
        for site, w in matmul_weights(load_graph(safe_join(src, g.file), True).graph):
            spec = choose(site)
            if spec is not None:
                yield site, w, spec


def own_grids(src: Path, manifest: Manifest, options: QuantizeOptions) -> dict[str, Scheme] | None:
    """{weight: its own grid's scheme} for every linear `options` would make 4-bit, if each lies on one and at
    least one is 4-bit; None at the first that lies on none (or when none is 4-bit)."""
    found: dict[str, Scheme] = {}
    for site, w, spec in _linears(src, manifest, options):
        if spec.scheme.bits != 4 or site.name in found:
            continue
        scheme = own_scheme(w, spec.scheme.block_size) if spec.scheme.block_size else None
        if scheme is None:
            return None
        found[site.name] = scheme
    return found if any(s.bits == 4 for s in found.values()) else None


def resolve(src: Path, manifest: Manifest, options: QuantizeOptions,
            log: Callable[[str], None]) -> QuantizeOptions:
    """`options` with `keep_grids` resolved: 4-bit linears all on grids -> `--method grid` with every linear's own
    scheme (block_min "on" when any has offsets); 8-bit linears on a grid -> `on_grids` (rounded to nearest); either
    with `on_grids`' fields; else `options` as they are (float weights: the profile's settings)."""
    if not options.keep_grids:
        return options
    if options.bits == 8:
        return _int8(src, manifest, options, log)
    if options.bits != 4 or options.format != "fast" or not options.symmetric or options.group == 0:
        return options
    found = own_grids(src, manifest, dataclasses.replace(options, block_min="off"))
    if not found:
        return options
    kinds: dict[str, int] = {}
    for s in found.values():
        label = ("4-bit with offsets (Q4_1/Q4_K)" if s.offsets else "4-bit symmetric (Q4_0)" if s.bits == 4
                 else "8-bit symmetric at block 16 (Q6_K)" if s.block_size == 16
                 else f"8-bit symmetric at block {s.block_size} (Q5_0/Q8_0)")
        kinds[label] = kinds.get(label, 0) + 1
    log(f"--block-min auto: all {len(found)} linears lie on llama.cpp grids (a model converted from a GGUF), kept "
        f"exactly: {', '.join(f'{n} {k}' for k, n in kinds.items())}"
        + (f" (not --method {options.method}, which would move them off)" if options.method != "rtn" else "")
        + ("; --block-min off decodes faster, at a second rounding's error" if any(s.offsets for s in found.values())
           else ""))
    kept = tuple(sorted((name, s.bits, s.block_size, s.offsets) for name, s in found.items()))
    return dataclasses.replace(options, **dict(options.on_grids), method="grid", kept_grids=kept,
                               block_min="on" if any(s.offsets for s in found.values()) else "off")


def _int8(src: Path, manifest: Manifest, options: QuantizeOptions, log: Callable[[str], None]) -> QuantizeOptions:
    """`--bits 8`: AWQ (the profile's int8 method) is the better int8 of float weights, but weights that lie on a
    llama.cpp grid it moves off, where rounding to nearest keeps them (profiles.py): a model converted from a GGUF
    (every linear on a grid) gets `on_grids` (the method rtn, unless --method was given)."""
    if not options.on_grids or not _all_on_grids(src, manifest, options):
        return options
    log("--block-min auto: the linears lie on llama.cpp grids (a model converted from a GGUF): int8 rounds them to "
        "nearest (--method rtn), which keeps them closer than AWQ's search")
    return dataclasses.replace(options, **dict(options.on_grids))


def _all_on_grids(src: Path, manifest: Manifest, options: QuantizeOptions) -> bool:
    """Whether every linear the plan quantizes (K a multiple of 32) lies on a llama.cpp grid at blocks of 32, as a
    GGUF's all do (the 4-bit rule's, `own_grids`); float weights end the scan at their first linear."""
    seen = False
    for _, w, _ in _linears(src, manifest, options):   # one weight in memory at a time
        if w.shape[1] % 32 == 0:
            if own_scheme(w, 32) is None:
                return False
            seen = True
    return seen
