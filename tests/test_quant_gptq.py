"""GPTQ (quant/gptq.py), block-wise int8 and the measured-sensitivity choice of mixed precision (quant/mixed.py),
each against its definition on small weights and calibration rows built here."""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.quant.gptq import gptq_quantize, output_error
from edgellm.quant.methods import quantize_weight
from edgellm.quant.mixed import Sensitivity, choose, relative_output_error
from edgellm.quant.schemes import Scheme, dequantize, quant_error, quantize


def calibration(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    """Correlated rows X [T, K] with a few loud channels, as LLM activations are."""
    x = rng.standard_normal((t, k)).astype(np.float32) @ (
        np.eye(k, dtype=np.float32) + 0.3 * rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k))
    x[:, :4] *= 8.0
    return x


@pytest.mark.parametrize("scheme", [Scheme(4, 32, True), Scheme(4, 64, False), Scheme(4, 0, True),
                                    Scheme(8, 32, True)], ids=lambda s: s.label)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_layer_output_error_below_rtn(scheme: Scheme, act_order: bool) -> None:
    rng = np.random.default_rng(1)
    n, k = 48, 128
    x = calibration(rng, 512, k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    h = x.T.astype(np.float64) @ x
    qw = gptq_quantize(w, h, scheme, act_order)
    got = dequantize(qw)
    assert qw.codes.max() <= scheme.qmax and qw.scales.shape == (n, scheme.n_blocks(k))
    # the stored codes decode on their own grid: re-quantizing with the same scales is exact
    assert np.array_equal(dequantize(quantize(got, scheme, qw.scales, None if scheme.symmetric else qw.zero_points)), got)
    rtn = output_error(w, dequantize(quantize(w, scheme)), h)
    mse = output_error(w, dequantize(quantize_weight(w, scheme, "mse", np.sqrt(np.diag(h)))), h)
    gptq = output_error(w, got, h)
    assert gptq < 0.8 * rtn and gptq < mse                   # measured: 0.2-0.7x RTN's on these rows
    # and it is the output error it lowers: ||X (W - Wq)^T||^2 computed directly agrees
    assert np.isclose(gptq, float(np.sum((x.astype(np.float64) @ (w - got).T.astype(np.float64)) ** 2)), rtol=1e-3)


def test_gptq_handles_dead_input_channels() -> None:
    rng = np.random.default_rng(2)
    x = calibration(rng, 256, 64)
    x[:, 10] = 0.0                                           # a channel the calibration never excites
    w = rng.standard_normal((16, 64)).astype(np.float32)
    got = dequantize(gptq_quantize(w, x.T.astype(np.float64) @ x, Scheme(4, 32, True)))
    assert np.all(np.isfinite(got)) and np.all(got[:, 10] == 0.0)


def test_block_int8_error_is_at_most_per_channel_with_outliers() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 576)).astype(np.float32) * 0.02
    w[rng.integers(0, 64, 40), rng.integers(0, 576, 40)] = 0.5            # sparse outliers, as in LLM weights
    per_channel = quant_error(w, quantize(w, Scheme(8, 0, True))).rel_rms_err
    for block in (32, 64, 128):
        assert quant_error(w, quantize(w, Scheme(8, block, True))).rel_rms_err <= per_channel
    assert quant_error(w, quantize(w, Scheme(8, 32, True))).rel_rms_err < 0.5 * per_channel


def test_sensitivity_is_the_relative_output_error() -> None:
    rng = np.random.default_rng(4)
    x = calibration(rng, 256, 64)
    h = x.T.astype(np.float64) @ x
    smooth = rng.standard_normal((32, 64)).astype(np.float32)
    spiky = smooth.copy()
    spiky[np.arange(32), rng.integers(0, 64, 32)] = 12.0    # one outlier per row: coarse int4 steps for its block
    s4 = Scheme(4, 32, True)
    d = smooth - dequantize(quantize(smooth, s4))
    want = np.sum((x @ d.T) ** 2) / np.sum((x @ smooth.T) ** 2)
    assert np.isclose(relative_output_error(smooth, s4, h), want, rtol=1e-3)
    assert relative_output_error(spiky, s4, h) > 2 * relative_output_error(smooth, s4, h)
    assert relative_output_error(smooth, Scheme(8, 32, True), h) < relative_output_error(smooth, s4, h) / 100


def test_mixed_precision_promotes_the_most_sensitive_weights_first() -> None:
    found = [Sensitivity("a", 1000, 0.010, 0.0001), Sensitivity("b", 1000, 0.050, 0.0002),
             Sensitivity("c", 4000, 0.080, 0.0003), Sensitivity("d", 500, 0.004, 0.0)]
    assert choose(found, 0.0) == frozenset()
    assert choose(found, 1000 / 6500) == {"b"}                    # highest gain per parameter
    assert choose(found, 2000 / 6500) == {"b", "a"}               # then the next, not the biggest gain
    assert choose(found, 1.0) == {"a", "b", "c", "d"}
