"""The two on-disk packings of a QuantizedWeight (quant/schemes.py: codes, scales, zero points in the canonical
[N, K] layout) and back.

Packings:
  MatMulNBits (bits 4|8): B uint8 [N, n_blocks, block_size * bits / 8], codes along K, low nibble first;
    scales float32 [N, n_blocks]; zero_points uint8 [N, ceil(n_blocks * bits / 8)] packed the same way,
    omitted when symmetric (and with block offsets, Scheme.offsets: float32 [N, n_blocks] the rewrite adds).
    K is zero-padded to n_blocks * block_size (pad codes = zero point). The CPU kernel takes block_size 16..256
    only, so a per-channel weight is stored as 256-blocks that repeat its row scale (`expand_per_channel`): same
    codes, same numerics.
  DequantizeLinear (opset 21): x [K, N] int8/uint8 or int4/uint4 (two per byte, low nibble first, in
    row-major order, as ONNX packs 4-bit tensors); per-axis: scale [N], axis=1; block-wise: scale
    [ceil(K / block_size), N], axis=0, block_size attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.runtime.errors import need

from .schemes import QuantizedWeight, Scheme

# ---------------------------------------------------------------- 4-bit packing

def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pairs along the last axis -> one byte each, first value in the low nibble (int4 as two's complement).

    An odd last axis is padded with a zero nibble.
    """
    v = np.asarray(values)
    v = (v.view(np.uint8) if v.dtype == np.int8 else v.astype(np.uint8)) & np.uint8(0xF)
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, count: int, signed: bool = False) -> np.ndarray:
    """Inverse of `pack_nibbles`: bytes [..., m] -> [..., count] uint8 (or int8 when `signed`)."""
    p = np.asarray(packed, np.uint8)
    v = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (-1,))[..., :count]
    if signed:
        return np.where(v >= 8, v.astype(np.int16) - 16, v).astype(np.int8)
    return v


# ---------------------------------------------------------------- com.microsoft::MatMulNBits

@dataclass
class NBitsArrays:
    """The initializers of one MatMulNBits node (see the module docstring for layouts)."""

    b: np.ndarray                    # uint8 [N, n_blocks, blob_size]
    scales: np.ndarray               # float32 [N, n_blocks]
    zero_points: np.ndarray | None   # uint8 [N, ceil(n_blocks * bits / 8)], None when symmetric
    bits: int
    block_size: int
    k: int
    n: int
    offsets: np.ndarray | None = None   # float32 [N, n_blocks]: block minima m (Scheme.offsets); the codes are then
                                        # stored symmetric ((code - 8) * s) and the rewrite adds the term of m + 8 s


def expand_per_channel(qw: QuantizedWeight, block_size: int = 0) -> QuantizedWeight:
    """Re-express a per-channel weight block-wise with the same codes: each row's scale repeated per block.

    MatMulNBits has no per-channel form (its CPU kernel takes blocks of 16..256), but this keeps the exact
    per-channel numerics at a cost of 4 bytes per block. The default block is 256 (1.6% overhead, and the
    fastest int8 block measured), or the smallest power of two >= K when K is below 256.
    """
    need(qw.scheme.block_size == 0, f"expand_per_channel needs a per-channel weight, got {qw.scheme.label}")
    block_size = block_size or min(256, max(16, 1 << (qw.k - 1).bit_length()))
    scheme = Scheme(qw.scheme.bits, block_size, qw.scheme.symmetric)
    n, nb = qw.codes.shape[0], scheme.n_blocks(qw.k)
    codes = np.empty((n, nb * block_size), np.uint8)
    codes[:] = qw.zero_points[:, :1]           # padding decodes to 0
    codes[:, :qw.k] = qw.codes[:, :qw.k]
    return QuantizedWeight(scheme, qw.k, codes, np.repeat(qw.scales[:, :1], nb, axis=1),
                           np.repeat(qw.zero_points[:, :1], nb, axis=1))


def to_matmulnbits(qw: QuantizedWeight) -> NBitsArrays:
    """Pack a QuantizedWeight for MatMulNBits (a per-channel weight goes through `expand_per_channel`)."""
    if qw.scheme.block_size == 0:
        qw = expand_per_channel(qw)
    s = qw.scheme
    n, nb = qw.scales.shape
    blocks = qw.codes.reshape(n, nb, s.block_size)
    b = pack_nibbles(blocks) if s.bits == 4 else blocks.copy()
    zp = None
    if not s.symmetric and not s.offsets:
        zp = pack_nibbles(qw.zero_points) if s.bits == 4 else qw.zero_points.copy()
    offsets = None if qw.offsets is None else qw.offsets.copy()
    return NBitsArrays(b, qw.scales.copy(), zp, s.bits, s.block_size, qw.k, n, offsets)


def from_matmulnbits(arrays: NBitsArrays) -> QuantizedWeight:
    """Unpack MatMulNBits initializers back to the canonical form (tests and error reports)."""
    n, nb, _ = arrays.b.shape
    bs = arrays.block_size
    symmetric = arrays.zero_points is None and arrays.offsets is None
    scheme = Scheme(arrays.bits, bs, symmetric, arrays.offsets is not None)
    codes = unpack_nibbles(arrays.b, bs) if arrays.bits == 4 else arrays.b
    if symmetric:
        zp = np.full((n, nb), scheme.mid, np.uint8)
    elif scheme.offsets:
        zp = np.zeros((n, nb), np.uint8)
    else:
        zp = unpack_nibbles(arrays.zero_points, nb) if arrays.bits == 4 else arrays.zero_points
    return QuantizedWeight(scheme, arrays.k, codes.reshape(n, nb * bs), arrays.scales, zp, arrays.offsets)


# ---------------------------------------------------------------- ONNX DequantizeLinear (opset 21)

@dataclass
class DQArrays:
    """DequantizeLinear inputs for a MatMul B of shape [K, N]; 4-bit values unpacked (pack on write)."""

    x: np.ndarray                    # [K, N] int8 (symmetric) or uint8 (asymmetric) values
    scale: np.ndarray                # float32 [N] (per-axis) or [n_blocks, N] (block-wise)
    zero_point: np.ndarray | None    # uint8, same shape as scale; None when symmetric
    axis: int                        # 1 per-axis (over N), 0 block-wise (blocks along K)
    block_size: int                  # 0 = per-axis
    bits: int


def to_dequantize_linear(qw: QuantizedWeight) -> DQArrays:
    """Canonical [N, K] codes -> DequantizeLinear arrays in MatMul layout [K, N]."""
    s = qw.scheme
    need(qw.offsets is None, "block offsets have no DequantizeLinear form (its zero point is an integer)")
    codes = qw.codes[:, :qw.k]
    if s.symmetric:
        x = (codes.astype(np.int16) - s.mid).astype(np.int8).T.copy()
        zp = None
    else:
        x = codes.T.copy()
        zp = qw.zero_points.T.copy()
    scale = qw.scales.T.copy()
    if s.block_size == 0:     # one block per output channel: the per-axis form
        return DQArrays(x, scale[0], None if zp is None else zp[0], 1, 0, s.bits)
    return DQArrays(x, scale, zp, 0, s.block_size, s.bits)
