"""Weight quantization schemes: integer codes, dequantization and error.

Canonical layout: every function here takes a weight `w` of shape [N, K] (N outputs, K inputs: the
`nn.Linear` layout). Blocks run along K, which is also how `com.microsoft::MatMulNBits` stores B. An
ONNX `MatMul` initializer is [K, N], so the rewrite passes `B.T`.

Codes are always stored unsigned, with a zero point: dequantized = (code - zero_point) * scale.
  symmetric:  q = clip(round(w / s), -2^(b-1), 2^(b-1) - 1), code = q + 2^(b-1), zero_point = 2^(b-1)
              (MatMulNBits' implicit zero point; ONNX int8/int4 takes q itself with no zero point).
              8 bits: s = max|w| / 127 (llama.cpp's Q8_0 rule). 4 bits: s = w_ext / -8 with w_ext the block's
              value of largest magnitude, sign kept (llama.cpp's Q4_0 rule): w_ext lands exactly on code -8
              and all 16 codes are used, a step of max|w|/8 instead of max|w|/7 (s may be negative).
  asymmetric: code = clip(round(w / s) + zp, 0, 2^b - 1), zp = round(-lo / s), with the block range
              [lo, hi] widened to include 0 (as MLAS does) so zp is an exact integer inside [0, 2^b - 1].
  offsets:    (4 bits, `Scheme.offsets`) a float offset per block beside the scale, llama.cpp Q4_1's layout:
              dequantized = code * s + m, s = (hi - lo) / 15 and m = lo, both rounded to fp16 (Q4_1's d and m),
              with [lo, hi] the block's own range (not widened to 0); zero points all 0 here. MatMulNBits gets them
              as symmetric codes, (code - 8) * s, and the rewrite adds the term of m + 8 s (quant/rewrite.py):
              activations rounded to int8 (accuracy level 4) then meet centred weights, as with the symmetric
              scheme. Weights that already lie on such a grid (dequantized Q4_1 blocks) come back exactly
              (`--block-min auto` keeps any llama.cpp grid with the step and offset it recovers: quant/gridfit.py).
Rounding is half-to-even (`np.rint`), as ONNX QuantizeLinear and MLAS' vector quantizers do. The kernels
only ever dequantize, so any rounding is "correct" for them; half-to-even keeps the RTN bound
|w - dequantize(w)| <= scale / 2 and is unbiased.

The two on-disk packings (MatMulNBits, DequantizeLinear): quant/packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.runtime.errors import need

BLOCK_SIZES = (0, 16, 32, 64, 128, 256)
_CHUNK_ELEMENTS = 1 << 22       # work on ~4M weights at a time: bounded memory even for a 150k-row lm_head


def row_chunks(n: int, k: int, parts: int = 1) -> list[slice]:
    """Row ranges of ~4M elements covering [0, n), at least `parts` of them where n allows."""
    rows = max(1, min(_CHUNK_ELEMENTS // max(k, 1), -(-n // parts)))
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


@dataclass(frozen=True)
class Scheme:
    """How one weight is quantized: `bits` 4|8; `block_size` along K (0 = one block per output channel)."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    offsets: bool = False      # a float offset per block (see the module docstring); 4-bit blocks only

    def __post_init__(self) -> None:
        need(self.bits in (4, 8), f"quantization bits must be 4 or 8, got {self.bits}")
        need(not self.offsets or (self.bits == 4 and self.block_size > 0 and not self.symmetric),
             "block offsets need 4-bit blocks (a block size, unsigned codes with zero point 0)")
        # 16..256 is what onnxruntime's CPU MatMulNBits kernel accepts (the op schema allows any power of 2)
        need(self.block_size in BLOCK_SIZES,
             f"quantization block size must be 0 (per channel) or one of 16, 32, 64, 128, 256, got {self.block_size}")

    @property
    def label(self) -> str:
        group = f"g{self.block_size}" if self.block_size else "ch"
        kind = "min" if self.offsets else "sym" if self.symmetric else "asym"
        return f"int{self.bits}-{group}-{kind}"

    def block_len(self, k: int) -> int:
        return self.block_size or k

    def n_blocks(self, k: int) -> int:
        return -(-k // self.block_len(k))

    @property
    def qmax(self) -> int:
        """Largest unsigned code, 2^bits - 1."""
        return (1 << self.bits) - 1

    @property
    def mid(self) -> int:
        """Implicit zero point of symmetric codes, 2^(bits-1)."""
        return 1 << (self.bits - 1)


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight in the canonical unpacked form every packing is made from."""

    scheme: Scheme
    k: int                     # true K; codes may be padded past it
    codes: np.ndarray          # uint8 [N, n_blocks * block_len], unsigned codes in [0, 2^bits - 1]
    scales: np.ndarray         # float32 [N, n_blocks]
    zero_points: np.ndarray    # uint8 [N, n_blocks] (all 2^(bits-1) when symmetric)
    offsets: np.ndarray | None = None   # float32 [N, n_blocks] with Scheme.offsets, else None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.k)

    def rows(self, sl: slice) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets[sl]
        return QuantizedWeight(self.scheme, self.k, self.codes[sl], self.scales[sl], self.zero_points[sl], offsets)


@dataclass(frozen=True)
class QuantError:
    max_abs_err: float
    rel_rms_err: float         # ||W - Wq||_F / ||W||_F


# ---------------------------------------------------------------- blocks, parameters, codes

def to_blocks(w: np.ndarray, block_len: int) -> np.ndarray:
    """[N, K] -> float32 [N, n_blocks, block_len], zero-padded along K."""
    need(w.ndim == 2, f"weight must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    nb = -(-k // block_len)
    out = np.zeros((n, nb * block_len), np.float32)
    out[:, :k] = w
    return out.reshape(n, nb, block_len)


def block_range(wb: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-block (lo, hi) [N, n_blocks] that the codes must cover; always contains 0 (the same for both
    symmetries: `params_from_range` makes a symmetric grid around 0 from it)."""
    return np.minimum(wb.min(axis=-1), 0.0), np.maximum(wb.max(axis=-1), 0.0)


def params_from_range(lo: np.ndarray, hi: np.ndarray, scheme: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """Scale float32 and zero point uint8 [N, n_blocks] mapping [lo, hi] (lo <= 0 <= hi) onto the codes."""
    if scheme.symmetric:
        zp = np.full(np.shape(lo), scheme.mid, np.uint8)
        if scheme.bits == 8:     # max|w| maps onto +-127: RTN never clamps
            return (np.maximum(-lo, hi) / (scheme.mid - 1)).astype(np.float32), zp
        # 4 bits: the extreme value (sign kept) onto code -8; the other side's values past 7.5 |s| clamp to 7
        ext = np.where(-lo >= hi, lo, hi)
        return (ext / -scheme.mid).astype(np.float32), zp
    scale = ((hi - lo) / scheme.qmax).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    zp = np.clip(np.rint(-lo / safe), 0, scheme.qmax)
    return scale, np.where(scale > 0, zp, scheme.mid).astype(np.uint8)


def offset_params(wb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale and offset float32 [N, n_blocks] of blocks [N, nb, bl] (Scheme.offsets): Q4_1's d = (hi - lo) / 15
    and m = lo, both rounded to fp16."""
    lo, hi = wb.min(axis=-1), wb.max(axis=-1)
    return ((hi - lo) / 15).astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)


def codes_for(wb: np.ndarray, scale: np.ndarray, zp: np.ndarray, scheme: Scheme,
              offset: np.ndarray | None = None) -> np.ndarray:
    """Round blocks [N, nb, bl] onto the grid given per-block scale/zp (and offset) [N, nb] -> uint8 codes."""
    s = scale[..., None]
    if offset is not None:
        wb = wb - offset[..., None]
    q = np.where(s != 0, np.rint(wb / np.where(s != 0, s, 1.0)), 0.0) + zp[..., None].astype(np.float32)
    return np.clip(q, 0, scheme.qmax).astype(np.uint8)


def dequantize_blocks(codes: np.ndarray, scale: np.ndarray, zp: np.ndarray,
                      offset: np.ndarray | None = None) -> np.ndarray:
    """uint8 codes [N, nb, bl] -> float32 [N, nb, bl], exactly (code - zp) * scale (+ offset) in float32."""
    w = (codes.astype(np.float32) - zp[..., None].astype(np.float32)) * scale[..., None]
    return w if offset is None else w + offset[..., None]


def quantize(w: np.ndarray, scheme: Scheme, scales: np.ndarray | None = None,
             zero_points: np.ndarray | None = None, offsets: np.ndarray | None = None) -> QuantizedWeight:
    """Quantize w [N, K]; scales/zero_points [N, n_blocks] default to round-to-nearest over the full range
    (with Scheme.offsets: scales and `offsets` given together, or both from each block's min..max)."""
    n, k = w.shape
    bl, nb = scheme.block_len(k), scheme.n_blocks(k)
    if scheme.offsets:
        need((scales is None) == (offsets is None) and zero_points is None,
             "block offsets: give the steps and offsets together (or neither: min..max)")
        return _quantize_offsets(w, scheme, scales, offsets)
    if scales is None:
        params = [params_from_range(*block_range(to_blocks(w[sl], bl), scheme.symmetric), scheme)
                  for sl in row_chunks(n, k)]
        scales, zero_points = (np.concatenate(p) for p in zip(*params, strict=True))
    elif zero_points is None:
        zero_points = np.full(scales.shape, scheme.mid, np.uint8)
    need(scales.shape == (n, nb) and zero_points.shape == (n, nb),
         f"scales and zero points must be [{n}, {nb}] for a [{n}, {k}] weight, got {scales.shape}")
    need(not scheme.symmetric or bool(np.all(zero_points == scheme.mid)),
         "symmetric quantization needs every zero point at 2^(bits-1)")
    scales = np.ascontiguousarray(scales, np.float32)
    zero_points = np.ascontiguousarray(zero_points, np.uint8)
    codes = np.empty((n, nb * bl), np.uint8)
    for sl in row_chunks(n, k):
        codes[sl] = codes_for(to_blocks(w[sl], bl), scales[sl], zero_points[sl], scheme).reshape(-1, nb * bl)
    return QuantizedWeight(scheme, k, codes, scales, zero_points)


def _quantize_offsets(w: np.ndarray, scheme: Scheme, steps: np.ndarray | None,
                      minima: np.ndarray | None) -> QuantizedWeight:
    n, k = w.shape
    bl, nb = scheme.block_len(k), scheme.n_blocks(k)
    codes = np.empty((n, nb * bl), np.uint8)
    scales, offsets = np.empty((n, nb), np.float32), np.empty((n, nb), np.float32)
    zp = np.zeros((n, nb), np.uint8)
    for sl in row_chunks(n, k):
        wb = to_blocks(w[sl], bl)
        scales[sl], offsets[sl] = offset_params(wb) if steps is None else (steps[sl], minima[sl])
        codes[sl] = codes_for(wb, scales[sl], zp[sl], scheme, offsets[sl]).reshape(-1, nb * bl)
    return QuantizedWeight(scheme, k, codes, scales, zp, offsets)


# the fast format's offset term (quant/rewrite.py), (m + 8 s) * block [N, nb], as an 8-bit MatMulNBits: 8-bit symmetric
# blocks of 16 of a row's block offsets. A step is 1/254 of 16 midpoints' range where a 4-bit one is 1/15 of a
# block's: searched offsets are snapped onto it (methods.snap_offsets), so the graph computes the weight reported
OFFSET_TERM = Scheme(8, 16, True)


def offset_term(offsets: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """float32 [N, nb]: the weights (m + 8 s) * block of the term (block means of A) @ them that adds a 4-bit
    weight's block offsets m to MatMulNBits' symmetric (code - 8) * s (block a power of two: exact)."""
    return ((offsets + np.float32(8) * scales) * np.float32(block)).astype(np.float32)


def snapped_term(offsets: np.ndarray, scales: np.ndarray, block: int) -> QuantizedWeight | None:
    """The offset term of these offsets and steps [N, nb] on its 8-bit grid (OFFSET_TERM), if it lies there (snapped
    offsets) within float32's rounding of m + 8 s (where m ~ -8 s, a few ulps of 8 s); None otherwise."""
    term = offset_term(offsets, scales, block)
    qw = quantize(term, OFFSET_TERM)
    slack = 1e-6 * (np.abs(offsets) + np.float32(8) * np.abs(scales)) * np.float32(block)
    return qw if bool(np.all(np.abs(dequantize(qw) - term) <= slack)) else None


def fp16_exact(scales: np.ndarray) -> bool:
    """Whether float32 scales survive a round trip through float16 unchanged."""
    return bool(np.array_equal(scales.astype(np.float16).astype(np.float32), scales))


def with_fp16_scales(w: np.ndarray, qw: QuantizedWeight, recode: bool = True) -> QuantizedWeight:
    """qw with its scales rounded to float16 (stored as fp16: half the scale bytes, llama.cpp's choice) and,
    with `recode`, the codes re-rounded on the rounded grid (RTN/mse; GPTQ keeps its compensated codes).
    Unchanged when a scale would not survive the rounding (a nonzero scale below fp16's smallest normal,
    2^-14 * 2^-10 subnormals aside, or above 65504): that weight keeps float32 scales."""
    s16 = qw.scales.astype(np.float16)
    if qw.offsets is not None:       # fp16-rounded already (Q4_1's d and m)
        return qw
    if not np.all(np.isfinite(s16)) or np.any((s16 == 0) != (qw.scales == 0)):
        return qw
    scales = s16.astype(np.float32)
    if not recode:
        return QuantizedWeight(qw.scheme, qw.k, qw.codes, scales, qw.zero_points)
    return quantize(w, qw.scheme, scales, qw.zero_points)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """QuantizedWeight -> float32 [N, K], the weight every packing below encodes."""
    n, nb = qw.scales.shape
    blocks = dequantize_blocks(qw.codes.reshape(n, nb, -1), qw.scales, qw.zero_points, qw.offsets)
    return blocks.reshape(n, -1)[:, :qw.k]


def quant_error(w: np.ndarray, qw: QuantizedWeight) -> QuantError:
    """Max |W - dequantize(Wq)| and relative RMS error ||W - Wq|| / ||W|| (0 for an all-zero W)."""
    worst, err2, norm2 = 0.0, 0.0, 0.0
    for sl in row_chunks(*w.shape):
        ref = np.asarray(w[sl], np.float32)
        d = ref - dequantize(qw.rows(sl))
        worst = max(worst, float(np.abs(d).max(initial=0.0)))
        err2 += float(np.sum(d * d, dtype=np.float64))
        norm2 += float(np.sum(ref * ref, dtype=np.float64))
    return QuantError(worst, float(np.sqrt(err2 / norm2)) if norm2 else 0.0)
