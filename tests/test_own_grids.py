"""A weight's own grid (quant/gridfit.py, `--block-min auto`'s grids.py): weights dequantized from llama.cpp blocks —
by gguf-py's reference dequantizers, from blocks its quantizers wrote or (Q4_K, Q6_K, which it cannot write)
random valid block bytes — are recognised and stored again bit for bit; float weights are not; and a tiny model
whose linears hold a Q4_K_M-like mix (Q4_K, Q5_0, Q6_K, Q8_0) comes back exactly through `edgellm quantize`."""

from __future__ import annotations

import json

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from edgellm.cli import main
from edgellm.export import ExportOptions, export_model
from edgellm.quant.gridfit import fit
from edgellm.quant.grids import own_scheme
from edgellm.quant.schemes import Scheme, dequantize
from edgellm.runtime.metrics import kl_divergence
from tests.export_helpers import onnx_generate_logits, tiny_model
from tests.quant_helpers import OPTIONS

RNG = np.random.default_rng(7)
BLOCK_BYTES = {T.Q4_K: 144, T.Q6_K: 210}   # per 256 weights: Q4_K d, dmin, 12 scale bytes, 128 code bytes; Q6_K ... d
SCALE_AT = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of the fp16 super-block scales (Q4_K d and dmin, Q6_K d)


def gguf_weight(kind: T, n: int = 32, k: int = 512, seed: int = 0) -> np.ndarray:
    """[n, k] float32 as gguf-py dequantizes llama.cpp blocks of `kind`."""
    rng = np.random.default_rng(seed)
    if kind in BLOCK_BYTES:            # random valid blocks with sane fp16 d (and dmin)
        raw = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
        d = np.frombuffer(rng.uniform(1e-4, 2e-3, n * k // 256).astype(np.float16).tobytes(), np.uint8)
        for at in SCALE_AT[kind]:
            raw[..., at:at + 2] = d.reshape(n, k // 256, 2)
        return gq.dequantize(raw.reshape(n, -1), kind).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    return gq.dequantize(gq.quantize(w, kind), kind).astype(np.float32)


@pytest.mark.parametrize(("kind", "want", "fp16_steps"), [
    (T.Q4_0, Scheme(4, 32, True), True),
    (T.Q4_1, Scheme(4, 32, False, True), True),
    (T.Q4_K, Scheme(4, 32, False, True), False),
    (T.Q5_0, Scheme(8, 32, True), True),
    (T.Q8_0, Scheme(8, 32, True), True),
    (T.Q6_K, Scheme(8, 16, True), False),
])
def test_llama_cpp_blocks_come_back_bit_for_bit(kind: T, want: Scheme, fp16_steps: bool) -> None:
    w = gguf_weight(kind)
    scheme = own_scheme(w, 32)
    assert scheme == want, kind.name
    qw = fit(w, scheme)
    assert qw is not None and np.array_equal(dequantize(qw), w), kind.name
    # the GGUF's own fp16 d (and m) where it has them; Q4_K's d * sc and Q6_K's d * scale are not fp16
    halves = np.array_equal(qw.scales.astype(np.float16).astype(np.float32), qw.scales)
    assert halves == fp16_steps, kind.name


def test_weights_on_no_grid_are_not_taken_for_one() -> None:
    assert own_scheme((RNG.standard_normal((16, 256)) * 0.02).astype(np.float32), 32) is None       # float
    q41 = gguf_weight(T.Q4_1)
    step = float(np.abs(np.diff(np.unique(q41[0, :32]))).min())
    assert own_scheme(q41 + np.float32(0.3 * step) * RNG.standard_normal(q41.shape).astype(np.float32), 32) is None
    # bf16-rounded float weights: values with 8-bit significands are still no 8-bit grid of 32 weights
    bf16 = torch.from_numpy((RNG.standard_normal((16, 256)) * 0.02).astype(np.float32)).bfloat16().float().numpy()
    assert own_scheme(bf16, 32) is None
    # Q6_K's scales change every 16 weights: no 8-bit grid at block 32, one at 16
    q6 = gguf_weight(T.Q6_K)
    assert fit(q6, Scheme(8, 32, True)) is None and fit(q6, Scheme(8, 16, True)) is not None
    # a 4-bit grid at 32 is none at 64 (two grids in a block)
    assert fit(gguf_weight(T.Q4_1), Scheme(4, 64, False, True)) is None


def _mix(name: str, w: np.ndarray, layer: int) -> np.ndarray:
    """A Q4_K_M-like mix on one tiny layer weight [N, K] (K a multiple of 32): which llama.cpp type each gets."""
    n, k = w.shape
    rng = np.random.default_rng(layer * 7 + len(name))
    nb = k // 32
    if name.endswith("attn.o.weight") or (name.endswith("mlp.down.weight") and layer % 2 == 0):   # Q4_K
        d = (rng.uniform(1e-3, 4e-3, (n, 1, 1)) * rng.integers(1, 64, (n, nb, 1)))
        m = rng.uniform(1e-3, 4e-3, (n, 1, 1)) * rng.integers(0, 64, (n, nb, 1))
        d, m = (x.astype(np.float32) for x in (d, m))
        return (d * rng.integers(0, 16, (n, nb, 32)).astype(np.float32) - m).reshape(n, k)
    if name.endswith("mlp.down.weight"):                                                         # Q6_K
        d = (np.float32(5e-4) * rng.integers(-127, 128, (n, k // 16, 1))).astype(np.float32)
        return (d * rng.integers(-32, 32, (n, k // 16, 16)).astype(np.float32)).reshape(n, k)
    kind = T.Q8_0 if name.endswith("attn.qkv.weight") and layer == 1 else T.Q5_0
    return gq.dequantize(gq.quantize(w * 0.3, kind), kind).astype(np.float32)


@pytest.fixture(scope="module")
def mix_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    model = tiny_model("llama2", seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.copy_(torch.from_numpy(_mix(name, p.numpy(), int(name.split(".")[1]))))
    export_model(model, tmp / "mix", ExportOptions(granularity="layer", **OPTIONS), progress=False, log=lambda _: None)
    return tmp / "mix"


def test_a_q4_k_m_like_mix_comes_back_exactly(mix_export, tmp_path, capsys) -> None:
    out = tmp_path / "int4"
    assert main(["quantize", str(mix_export), "-o", str(out), "--bits", "4", "--no-progress", "--no-check"]) == 0
    err = capsys.readouterr().err
    assert "all 8 linears lie on llama.cpp grids" in err
    assert "4 8-bit symmetric at block 32 (Q5_0/Q8_0)" in err and "3 4-bit with offsets (Q4_1/Q4_K)" in err
    assert "1 8-bit symmetric at block 16 (Q6_K)" in err
    record = json.loads((out / "manifest.json").read_text())["quantization"]
    o = record["options"]
    assert (o["method"], o["block_min"], o["head_int8_rows"]) == ("grid", "on", 0.45)
    # the profile's float-weight settings gave way to the grids' own (profiles.ON_GRIDS)
    assert (o["int8_fraction"], o["scales_dtype"], o["keep_grids"]) == (0.0, "auto", True)
    layers = {n: w for n, w in record["weights"].items() if n.startswith("layers.")}
    assert len(layers) == 8 and all(w["rel_rms_err"] < 1e-6 for w in layers.values())
    assert {(w["bits"], w["block_size"], w["offsets"]) for w in layers.values()} == {
        (8, 32, False), (4, 32, True), (8, 16, False)}
    assert main(["info", str(out)]) == 0
    assert "on their own grids (3 4-bit, 3 of them with block minima; 5 8-bit)" in capsys.readouterr().out
    # --profile small keeps the same grids with float16 scales and offsets and its 10 % of the table's rows int8: a
    # smaller file (Q4_0's class) that decodes faster
    small = tmp_path / "small"
    assert main(["quantize", str(mix_export), "-o", str(small), "--bits", "4", "--profile", "small", "--no-progress",
                 "--no-check"]) == 0
    s_record = json.loads((small / "manifest.json").read_text())["quantization"]
    assert (s_record["options"]["method"], s_record["options"]["scales_dtype"],
            s_record["options"]["head_int8_rows"]) == ("grid", "float16", 0.1)
    assert {n: (w["bits"], w["block_size"], w["offsets"]) for n, w in s_record["weights"].items()} == {
        n: (w["bits"], w["block_size"], w["offsets"]) for n, w in record["weights"].items()}

    def data_bytes(d):
        return sum(f.stat().st_size for f in d.glob("*.data"))
    assert data_bytes(small) < data_bytes(out)
    # the graphs compute it: closer to the mix model than a second rounding (AWQ's) gets
    off = tmp_path / "off"
    assert main(["quantize", str(mix_export), "-o", str(off), "--bits", "4", "--block-min", "off", "--no-progress",
                 "--no-check"]) == 0
    prompt = list(range(3, 19))
    ref, _ = onnx_generate_logits(mix_export, prompt, 0)
    kl = {d.name: float(kl_divergence(ref, onnx_generate_logits(d, prompt, 0)[0]).mean()) for d in (out, off)}
    assert kl["int4"] < 0.5 * kl["off"], kl


def test_weights_all_on_8_bit_grids_are_quantized_to_4_bits_as_asked(tmp_path, capsys) -> None:
    """A Q8_0 (or Q5_0) GGUF's linears lie on 8-bit grids only: --bits 4 is then not a 4-bit source kept, but a
    request to quantize; auto stays off and AWQ runs."""
    model = tiny_model("llama2", seed=6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.copy_(torch.from_numpy(gq.dequantize(gq.quantize(p.numpy(), T.Q8_0), T.Q8_0).astype(np.float32)))
    src = tmp_path / "q8"
    export_model(model, src, ExportOptions(granularity="layer", **OPTIONS), progress=False, log=lambda _: None)
    assert main(["quantize", str(src), "-o", str(tmp_path / "int4"), "--bits", "4", "--no-progress", "--no-check"]) == 0
    assert "--block-min auto" not in capsys.readouterr().err
    o = json.loads((tmp_path / "int4" / "manifest.json").read_text())["quantization"]["options"]
    assert (o["method"], o["block_min"], o["kept_grids"], o["head_int8_rows"]) == ("awq", "on", [], 1.0)  # balanced


def test_the_scan_samples_rows_and_storing_checks_them_all() -> None:
    """own_scheme judges SCAN_ROWS rows spread over a weight (grids.py); a weight with a row off its grid
    between them is named, and storing it (QuantPlan.quantize, which fits every row) stops with one line."""
    from edgellm.quant.grids import SCAN_ROWS
    from edgellm.quant.methods import QuantSpec
    from edgellm.quant.plan import QuantPlan, WeightSite
    from edgellm.runtime.errors import EdgeError

    w = gguf_weight(T.Q4_1, n=4 * SCAN_ROWS, k=256)
    scheme = own_scheme(w, 32)
    assert scheme == Scheme(4, 32, False, True)
    w[1] = (RNG.standard_normal(256) * 0.02).astype(np.float32)  # row 1 is not among the sampled rows
    assert own_scheme(w, 32) == scheme and fit(w, scheme) is None
    site = WeightSite("w", "MatMul", "n", "layers.0.mlp.down", w.shape)
    with pytest.raises(EdgeError, match=r"layers.0.mlp.down: some rows lie off the grid .* --block-min off"):
        QuantPlan(lambda _: None).quantize(site, w, QuantSpec(scheme, "grid"))
