"""`--group PATTERN=N` (issue 22): the block size of the matmul weights a pattern matches, whatever rule chose
their bits; the CLI's parsing and one-line errors for it are in test_quantize_cli."""

from __future__ import annotations

from edgellm.quant.options import QuantizeOptions
from edgellm.quant.plan import WeightSite
from edgellm.runtime.manifest import read_manifest
from tests.quant_helpers import export, quantize


def test_the_first_matching_rule_sets_the_block_size_of_matmul_weights_only() -> None:
    """int4 linears and the int8 lm_head alike; a row lookup (the tied table's Gather) keeps its own layout."""
    options = QuantizeOptions(bits=4, lm_head="int8", groups=(("layers.*.mlp.*", 64), ("layers.0.*", 128),
                                                               ("lm_head", 16)))
    choose = options.chooser(2)

    def spec(name: str, op: str = "MatMul"):
        return choose(WeightSite(name, op, "", name.removesuffix(".weight"), (64, 64)))
    blocks = [spec(n).scheme.block_size for n in ("layers.0.mlp.down.weight", "layers.0.attn.o.weight",
                                                 "layers.1.attn.o.weight", "embed.weight")]
    assert blocks == [64, 128, 32, 16] and spec("embed.weight", "Gather").scheme.block_size == 0
    assert (spec("layers.1.mlp.up.weight").scheme.bits, spec("embed.weight").scheme.bits) == (4, 8)


def test_the_quantized_export_records_each_weights_block_size(tmp_path) -> None:
    _, src = export(tmp_path, "from-scratch", "layer")
    out = quantize(src, tmp_path / "q", bits=8, groups=(("layers.*.mlp.down", 64),))
    q = read_manifest(out, verify=True).quantization
    w = q["weights"]
    assert (w["layers.1.mlp.down.weight"]["block_size"], w["layers.1.mlp.gate_up.weight"]["block_size"]) == (64, 32)
    assert q["options"]["groups"] == [["layers.*.mlp.down", 64]]
