"""Quantization primitives: error bounds, rounding, clamping, packing round-trips, scale search."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.quant.methods import (
    block_weights,
    quantize_weight,
    search_params,
    search_zero_points,
    weighted_sq_error,
)
from edgellm.quant.packing import (
    NBitsArrays,
    expand_per_channel,
    from_matmulnbits,
    pack_nibbles,
    to_dequantize_linear,
    to_matmulnbits,
    unpack_nibbles,
)
from edgellm.quant.schemes import (
    Scheme,
    codes_for,
    dequantize,
    dequantize_blocks,
    quant_error,
    quantize,
    to_blocks,
)
from edgellm.runtime.errors import EdgeError

SCHEMES = [Scheme(bits, bs, sym) for bits in (4, 8) for bs in (0, 16, 32, 64, 128, 256) for sym in (True, False)]


def weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows plus the awkward ones: all zero, all positive, one huge outlier."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0] = 0.0
    w[1] = np.abs(w[1]) + 0.5
    w[2, k // 3] = 40.0
    return w


def per_element(qw_param: np.ndarray, qw, k: int) -> np.ndarray:
    """[N, n_blocks] -> [N, K] by repeating each block's value over its elements."""
    return np.repeat(qw_param, qw.scheme.block_len(k), axis=1)[:, :k]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
@pytest.mark.parametrize("k", [64, 100, 288])
def test_rtn_error_within_half_step(scheme: Scheme, k: int) -> None:
    w = weights(12, k)
    qw = quantize(w, scheme)
    assert qw.codes.dtype == np.uint8 and int(qw.codes.max()) <= scheme.qmax
    if scheme.symmetric:
        assert np.all(qw.zero_points == scheme.mid)
    err = np.abs(w - dequantize(qw))
    step = np.abs(per_element(qw.scales, qw, k))
    if scheme.bits == 4 and scheme.symmetric:
        # Q4_0's rule: the extreme value lands exactly on code -8 (scale = w_ext / -8), the other side's
        # values past 7.5 steps clamp to +7 (error < 1 step); everything else is within half a step
        signed = w / np.where(step > 0, per_element(qw.scales, qw, k), 1.0)
        ext = np.abs(w) == per_element(np.abs(to_blocks(w, scheme.block_len(k))).max(-1), qw, k)
        assert np.all(err[ext & (step > 0)] <= 1e-6 * step[ext & (step > 0)])
        clamped = signed > 7.5
        assert np.all(err[clamped] < step[clamped] * (1 + 1e-5)) and np.all(signed >= -8 - 1e-5)
        assert np.all(err[~clamped] <= step[~clamped] / 2 * (1 + 1e-5) + 1e-7)
    else:
        assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(dequantize(qw)[0] == 0.0)                # an all-zero row stays exactly zero
    stats = quant_error(w, qw)
    assert stats.max_abs_err == pytest.approx(float(err.max()), rel=1e-6)
    assert stats.rel_rms_err == pytest.approx(float(np.linalg.norm(w - dequantize(qw)) / np.linalg.norm(w)), rel=1e-5)
    assert 0 < stats.rel_rms_err < (0.3 if scheme.bits == 4 else 0.03)     # loose: the outlier row dominates


def test_round_half_to_even_and_clamp() -> None:
    # per-channel int8: absmax 127 gives scale exactly 1, so w / s sits exactly on .5 ties
    w = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49, -126.0]], np.float32)
    qw = quantize(w, Scheme(8, 0, True))
    assert qw.scales[0, 0] == 1.0
    assert (qw.codes[0].astype(int) - 128).tolist() == [127, 0, 2, 2, 0, -2, 3, -126]
    # an explicit scale too small for the range clamps to [-8, 7] (int4) / [0, 15] (uint4)
    small = np.full((1, 1), 0.1, np.float32)
    sym = quantize(np.array([[5.0, -5.0, 0.1]], np.float32), Scheme(4, 0, True), small)
    assert (sym.codes[0].astype(int) - 8).tolist() == [7, -8, 1]
    asym = quantize(np.array([[5.0, -5.0]], np.float32), Scheme(4, 0, False), small, np.full((1, 1), 3, np.uint8))
    assert asym.codes[0].tolist() == [15, 0]


def test_asymmetric_zero_point_covers_one_sided_rows() -> None:
    w = np.linspace(1.0, 2.0, 32, dtype=np.float32)[None, :]       # never negative: range widened to 0
    qw = quantize(w, Scheme(4, 32, False))
    assert qw.zero_points[0, 0] == 0 and qw.scales[0, 0] == pytest.approx(2.0 / 15)
    assert np.abs(dequantize(qw) - w).max() <= qw.scales[0, 0] / 2 + 1e-7


def test_nibble_packing_is_low_first() -> None:
    assert pack_nibbles(np.array([1, 2, 15, 0], np.uint8)).tolist() == [0x21, 0x0F]
    assert pack_nibbles(np.array([-1, 3, -8], np.int8)).tolist() == [0x3F, 0x08]   # odd: zero high nibble
    assert unpack_nibbles(np.array([0x3F, 0x08], np.uint8), 3, signed=True).tolist() == [-1, 3, -8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=65))
def test_nibble_round_trip(values: list[int]) -> None:
    v = np.array(values, np.uint8)
    assert pack_nibbles(v).shape == ((len(v) + 1) // 2,)
    assert np.array_equal(unpack_nibbles(pack_nibbles(v), len(v)), v)
    s = (v.astype(np.int16) - 8).astype(np.int8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(s), len(s), signed=True), s)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.block_size], ids=lambda s: s.label)
@pytest.mark.parametrize("k", [64, 100, 288])
def test_matmulnbits_pack_round_trip(scheme: Scheme, k: int) -> None:
    w = weights(10, k, seed=1)
    qw = quantize(w, scheme)
    arr = to_matmulnbits(qw)
    nb = -(-k // scheme.block_size)
    assert arr.b.shape == (10, nb, scheme.block_size * scheme.bits // 8) and arr.b.dtype == np.uint8
    assert arr.scales.shape == (10, nb) and arr.scales.dtype == np.float32
    if scheme.symmetric:
        assert arr.zero_points is None
    else:
        assert arr.zero_points.shape == (10, -(-nb * scheme.bits // 8))
    if scheme.bits == 4:                                  # byte j of block i holds codes 2j (low), 2j+1 (high)
        first = qw.codes[3, :2].astype(int)
        assert int(arr.b[3, 0, 0]) == first[0] | (first[1] << 4)
    back = from_matmulnbits(arr)
    assert np.array_equal(back.codes, qw.codes)
    assert np.array_equal(back.zero_points, qw.zero_points)
    assert np.array_equal(dequantize(back), dequantize(qw))


def test_matmulnbits_asym_zero_points_pack_pairs_of_blocks() -> None:
    qw = quantize(weights(4, 96, seed=2), Scheme(4, 32, False))          # 3 blocks -> 2 zp bytes per row
    arr = to_matmulnbits(qw)
    zp = qw.zero_points.astype(int)
    assert arr.zero_points[1].tolist() == [zp[1, 0] | (zp[1, 1] << 4), zp[1, 2]]
    assert isinstance(arr, NBitsArrays) and arr.k == 96 and arr.n == 4


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_expands_to_blocks_without_changing_numerics(symmetric: bool) -> None:
    w = weights(6, 300, seed=3)
    qw = quantize(w, Scheme(8, 0, symmetric))
    ex = expand_per_channel(qw)
    assert ex.scheme.block_size == 256 and ex.scales.shape == (6, 2)
    assert np.array_equal(dequantize(ex), dequantize(qw))
    assert np.array_equal(dequantize(from_matmulnbits(to_matmulnbits(qw))), dequantize(qw))


@pytest.mark.parametrize("scheme", [Scheme(8, 0, True), Scheme(8, 0, False), Scheme(4, 32, True),
                                    Scheme(4, 32, False), Scheme(8, 64, True)], ids=lambda s: s.label)
def test_dequantize_linear_arrays_decode_to_the_same_weight(scheme: Scheme) -> None:
    w = weights(8, 100, seed=4)
    qw = quantize(w, scheme)
    a = to_dequantize_linear(qw)
    assert a.x.shape == (100, 8) and a.x.dtype == (np.int8 if scheme.symmetric else np.uint8)
    if scheme.block_size == 0:
        assert a.axis == 1 and a.scale.shape == (8,)
        scale, zp = a.scale[None, :], (0 if a.zero_point is None else a.zero_point[None, :].astype(np.float32))
    else:
        bs = scheme.block_size
        nb = -(-100 // bs)
        assert a.axis == 0 and a.scale.shape == (nb, 8) and a.block_size == bs
        rep = np.repeat(np.arange(nb), bs)[:100]
        scale = a.scale[rep]
        zp = 0 if a.zero_point is None else a.zero_point[rep].astype(np.float32)
    decoded = (a.x.astype(np.float32) - zp) * scale                  # the ONNX DequantizeLinear formula
    assert np.array_equal(decoded.T, dequantize(qw))


def test_bad_schemes_are_rejected() -> None:
    with pytest.raises(EdgeError, match="bits"):
        Scheme(3, 32)
    with pytest.raises(EdgeError, match="block size"):
        Scheme(4, 512)
    with pytest.raises(EdgeError, match="method"):
        quantize_weight(np.ones((2, 32), np.float32), Scheme(), "gptq")
    with pytest.raises(EdgeError, match="act_scale"):
        quantize_weight(np.ones((2, 32), np.float32), Scheme(), "mse", np.ones(31, np.float32))


# ---------------------------------------------------------------- scale choice

@pytest.mark.parametrize("kind", ["gaussian", "student-t3"])
@pytest.mark.parametrize("scheme", [Scheme(4, 32, True), Scheme(4, 32, False), Scheme(4, 128, True)],
                         ids=lambda s: s.label)
def test_mse_search_beats_rtn(kind: str, scheme: Scheme) -> None:
    rng = np.random.default_rng(5)
    shape = (128, 256)
    w = (rng.standard_normal(shape) if kind == "gaussian" else rng.standard_t(3, shape)).astype(np.float32) * 0.02
    rtn = weighted_sq_error(w, dequantize(quantize_weight(w, scheme, "rtn")))
    mse = weighted_sq_error(w, dequantize(quantize_weight(w, scheme, "mse")))
    assert mse < 0.97 * rtn                                 # measured: 4-26% lower


def test_mse_search_never_worse_per_block_and_act_weighting_helps() -> None:
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    act = np.exp(rng.standard_normal(256)).astype(np.float32)
    scheme = Scheme(4, 32, True)
    blocks = lambda d: (d.reshape(64, 8, 32) ** 2).sum(-1)     # noqa: E731
    rtn = dequantize(quantize_weight(w, scheme, "rtn"))
    mse = dequantize(quantize_weight(w, scheme, "mse"))
    assert np.all(blocks(w - mse) <= blocks(w - rtn) * (1 + 1e-6))
    aware = dequantize(quantize_weight(w, scheme, "mse", act))
    assert weighted_sq_error(w, aware, act) < 0.8 * weighted_sq_error(w, mse, act)


def test_asymmetric_k_quant_candidates_never_lose_a_block_to_the_clip_search() -> None:
    """Integer zero points: llama.cpp's k-quant candidates (step from min..max at 15 + r steps, zero point rounded,
    least-squares step) are kept per block only where they beat the clip search; on a heavy-tailed weight they
    lower the weighted error by more than 3 % (measured 5-7 % on SmolLM2's off-grid linears)."""
    rng = np.random.default_rng(8)
    w = (rng.standard_t(4, (64, 256)) * 0.02 + rng.uniform(-0.01, 0.03, (64, 1))).astype(np.float32)
    act = np.exp(0.5 * rng.standard_normal(256)).astype(np.float32)
    scheme = Scheme(4, 32, False)
    wb, weights = to_blocks(w, 32), block_weights(act, 256, 32)
    clip = search_params(wb, scheme, weights)
    both = search_zero_points(wb, scheme, weights, *clip)
    errs = [weights * (dequantize_blocks(codes_for(wb, s, z, scheme), s, z) - wb) ** 2 for s, z in (clip, both)]
    assert np.all(errs[1].sum(-1) <= errs[0].sum(-1) * (1 + 1e-6))
    assert errs[1].sum() < 0.97 * errs[0].sum(), errs[1].sum() / errs[0].sum()
    assert np.array_equal(dequantize(quantize_weight(w, scheme, "mse", act)).reshape(64, 8, 32),
                          dequantize_blocks(codes_for(wb, *both, scheme), *both))


def test_row_chunking_does_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weights(40, 100, seed=7)
    scheme = Scheme(4, 32, False)
    whole = [quantize_weight(w, scheme, m) for m in ("rtn", "mse")]
    err = quant_error(w, whole[0])
    monkeypatch.setattr("edgellm.quant.schemes._CHUNK_ELEMENTS", 300)      # 3 rows per chunk
    for ref, m in zip(whole, ("rtn", "mse"), strict=True):
        got = quantize_weight(w, scheme, m)
        assert np.array_equal(got.codes, ref.codes) and np.array_equal(got.scales, ref.scales)
    chunked = quant_error(w, whole[0])
    assert chunked.max_abs_err == err.max_abs_err and chunked.rel_rms_err == pytest.approx(err.rel_rms_err)
