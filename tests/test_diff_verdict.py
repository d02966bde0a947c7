"""The diff report's verdict (edgellm/diff/verdict.py) on numbers given here: which variant it ships under
the default and a --fail-if bar, which layer it blames, and that its suggested `edgellm quantize` command is
one the real CLI parser and option checks accept. Plus the plot's tick thinning rule."""

from __future__ import annotations

import shlex

import pytest

from edgellm.cli import build_parser
from edgellm.cli.quantize import options_from_args
from edgellm.diff.fix_command import quantize_argv
from edgellm.diff.plots import _LABEL_IN, layer_figure_width, tick_step
from edgellm.diff.report_md import summary_markdown
from edgellm.diff.verdict import build_verdict, error_layers

FLOOR = 1e-3


def _layers(errors: list[float]) -> list[dict]:
    return [{"layer": i, "hidden": None, "key": None, "value": None, "error": e} for i, e in enumerate(errors)]


def _variant(name: str, kl: float, top1: float, errors: list[float], options: dict | None = None,
             source_sha: str = "f" * 64) -> dict:
    quant = None if options is None else {"options": options, "source": {"manifest_sha256": source_sha}}
    return {"name": name, "path": f"/exp/{name}", "quantization": quant,
            "logits": {"kl": {"mean": kl, "p99": 5 * kl, "max": 9 * kl}, "top1": top1, "top5": 1.0,
                       "dp": {"mean": 0.0, "worst": 0.0, "rms": 0.0}},
            "ppl": {"ppl": 10.0, "ref_ppl": 10.0, "delta": 0.0, "delta_rel": 0.0},
            "greedy": {"agreement": 1.0, "agreed": 1, "total": 1},
            "per_layer": {"embed": {"rel_rms": 0.004}, "layers": _layers(errors), "first_drift_layer": None,
                          "largest_jump_layer": None, "worst_rel_rms": max(errors)}}


INT4 = {"bits": 4, "group_size": 32, "symmetric": True, "format": "fast", "method": "rtn", "embeddings": "int8",
        "lm_head": "int4", "keep": [], "int8_layers": [], "accuracy_level": 4, "calibration_tokens": 512, "seed": 0}
INT8 = {**INT4, "bits": 8, "group_size": 0, "lm_head": "int8"}
# layer 2 multiplies the error it receives by 8 (0.01 -> 0.08); layer 0 by 2.5 (0.004 -> 0.01)
INT4_ERRORS = [0.01, 0.01, 0.08, 0.085]


def _report(variants: list[dict], gate: list[str] | None = None) -> dict:
    return {"variants": variants, "settings": {"jump_floor": FLOOR},
            "gate": None if gate is None else {"conditions": gate, "failed": [], "passed": True},
            "reference": {"ppl": {"64": 10.0}}, "text": {"n_tokens": 64, "source": "generated"}}


def _facts(sizes: dict[str, int], weights: dict[str, dict[str, float]] | None = None) -> dict:
    return {name: {"bytes": size, "manifest_sha256": "f" * 64 if name == "fp32" else "0" * 64,
                   "weights": (weights or {}).get(name, {})} for name, size in sizes.items()}


def three_variants() -> tuple[dict, dict]:
    variants = [_variant("fp32", 1e-12, 1.0, [1e-7] * 4), _variant("int8", 2e-4, 0.99, [0.005] * 4, INT8),
                _variant("int4", 0.08, 0.85, INT4_ERRORS, INT4)]
    facts = _facts({"fp32": 4_000_000, "int8": 1_200_000, "int4": 800_000},
                   {"int4": {"layers.2.attn.qkv.weight": 0.09, "layers.2.mlp.down.weight": 0.12,
                             "layers.0.mlp.down.weight": 0.3, "lm_head.weight": 0.1}})
    return _report(variants), facts


def test_ships_the_smallest_variant_within_the_bar():
    report, facts = three_variants()
    v = build_verdict(report, facts)
    # default bar (kl>0.05, top1<0.9): int4 misses both, so the smallest passing one is int8
    assert v["bar"] == {"conditions": ["kl>0.05", "top1<0.9"], "source": "default"}
    assert v["ship"] == {"name": "int8", "bytes": 1_200_000, "size_vs_fp32": pytest.approx(0.3)}
    assert [r["passes"] for r in v["variants"]] == [True, True, False]
    assert v["text"].startswith("Ship int8 (1.20 MB, 0.30x of fp32)")
    assert "int4 (0.80 MB: mean KL 0.08 > 0.05, top-1 85 % < 90 %)" in v["text"]
    # a looser --fail-if gate moves the pick to int4 (the smallest), and the text names the gate
    v = build_verdict(_report(report["variants"], ["kl>0.1", "top1<0.8"]), facts)
    assert v["ship"]["name"] == "int4" and v["bar"]["source"] == "--fail-if"
    assert "mean KL ≤ 0.1 and top-1 ≥ 80 % (the --fail-if gate)" in v["text"]
    # a bar nothing meets: no pick, the closest one named
    v = build_verdict(_report(report["variants"], ["kl>1e-15"]), facts)
    assert v["ship"] is None and v["text"].startswith("No variant meets mean KL ≤ 1e-15")
    assert "the closest is fp32" in v["text"]


def test_names_the_layer_that_grows_the_error_and_its_worst_weight():
    report, facts = three_variants()
    v = build_verdict(report, facts)
    err = v["error"]
    assert err["variant"] == "int4"  # smaller than the pick but failing: the one worth fixing
    # growth: layer 0 0.01/0.004 = 2.5, layer 1 1.0 (not growing), layer 2 8, layer 3 1.06; half of 8 = 4
    assert [e["layer"] for e in err["layers"]] == [2]
    assert err["layers"][0]["growth"] == pytest.approx(8.0)
    assert err["layers"][0]["worst_weight"] == "layers.2.mlp.down.weight"  # not layer 0's bigger error
    assert "Most of int4's error enters at layer 2 (x8 to 0.08; its worst weight layers.2.mlp.down.weight" in v["text"]
    ranked = error_layers(report["variants"][2]["per_layer"], FLOOR)
    assert [e["layer"] for e in ranked] == [2, 0, 3]


def test_fix_command_is_pasteable_and_accepted_by_edgellm_quantize():
    report, facts = three_variants()
    fix = build_verdict(report, facts)["fix"]
    assert fix["pasteable"] and fix["argv"][:5] == ["edgellm", "quantize", "/exp/fp32", "-o", "/exp/int4-fix"]
    assert shlex.split(fix["command"]) == fix["argv"]
    args = build_parser().parse_args(fix["argv"][1:])
    opts = options_from_args(args)  # the CLI's own checks (EdgeError on a bad flag)
    opts.validate(n_layers=4)
    assert (opts.bits, opts.int8_layers, opts.head, opts.keep) == (4, (2,), "int8", ())
    assert "int8 linears in layer 2, an int8 lm_head" in build_verdict(report, facts)["text"]


@pytest.mark.parametrize(("options", "layers", "want"), [
    (INT8, [1, 3], dict(bits=8, keep=("layers.1.*", "layers.3.*"), int8_layers=(), head="int8")),
    ({**INT4, "group_size": 64, "symmetric": False, "method": "awq", "calibration_tokens": 256, "seed": 5,
      "lm_head": "fp32", "int8_layers": [0], "format": "portable", "accuracy_level": None},
     [0, 2], dict(bits=4, group=64, symmetric=False, method="awq", calibration_tokens=256, seed=5, head="fp32",
                  int8_layers=(0, 2), keep=("layers.0.*",), format="portable")),
    ({**INT4, "lm_head": "int8", "embeddings": "fp32", "keep": ["lm_head"]}, [],   # from before the head split
     dict(bits=4, head="int8", embeddings="fp32", keep=("lm_head",), int8_layers=(), head_int8_rows=1.0)),
    ({**INT4, "lm_head": "int8", "head_int8_rows": 0.3}, [1], dict(head="int8", head_int8_rows=0.3, int8_layers=(1,))),
    ({**INT4, "lm_head": "int8", "head_int8_rows": 0.5}, [1], dict(head="int8", head_int8_rows=0.5)),
    ({**INT4, "lm_head": "int4"}, [1], dict(head="int8", head_int8_rows=1.0, method="rtn", block_min="off",
                                           int8_fraction=0.0, scales_dtype="auto")),  # the fix's head: the default
    ({**INT4, "lm_head": "int8", "head_int8_rows": 0.3, "block_min": "on", "scales_dtype": "float16"}, [1],
     dict(block_min="on", method="rtn", scales_dtype="float16", int8_layers=(1,))),   # block minima kept
    ({**INT4, "method": "grid", "lm_head": "int8", "head_int8_rows": 0.45, "block_min": "on",
      "kept_grids": [["layers.0.attn.qkv.weight", 4, 32, True]]}, [1],
     dict(keep_grids=True, head_int8_rows=0.45, int8_fraction=0.0, int8_layers=(1,))),   # own grids: auto finds them
])
def test_fix_repeats_the_recorded_options(options, layers, want):
    """The command rebuilds the variant as it was quantized, plus the fix: int8 models keep the layers
    fp32, int4 ones make them int8 (fp32 if int8 already)."""
    argv = quantize_argv("src dir", "out", options, layers)
    opts = options_from_args(build_parser().parse_args(argv[1:]))
    opts.validate(n_layers=4)
    for key, value in want.items():
        assert getattr(opts, key) == value, key
    assert argv[2] == "src dir" and "'src dir'" in shlex.join(argv)


def test_unknown_source_is_a_named_placeholder_and_markdown_carries_the_verdict():
    report, facts = three_variants()
    del report["variants"][0]  # no fp32 export in the diff: the command cannot name it
    v = build_verdict(report, {k: f for k, f in facts.items() if k != "fp32"})
    assert not v["fix"]["pasteable"] and v["fix"]["argv"][2] == "FP32_EXPORT"
    assert "; FP32_EXPORT: the fp32 export it was quantized from), quantize again" in v["text"]
    report["variants"] = [{**x, "ppl": {**x["ppl"]}} for x in report["variants"]]
    report["verdict"] = v
    assert f"verdict: {v['text']}" in summary_markdown(report)


@pytest.mark.parametrize("n_layers", [2, 12, 30, 64, 200])
def test_layer_ticks_never_crowd(n_layers):
    """Labelled ticks (every step-th layer plus "embed") fit the axes' width at _LABEL_IN inches each;
    a 30-layer model still gets every layer labelled."""
    width = layer_figure_width(n_layers + 1)
    step = tick_step(n_layers + 1, width)
    labels = 1 + len(range(0, n_layers, step))
    assert labels * _LABEL_IN <= width
    assert step == 1 or labels * step * _LABEL_IN > width * 0.5  # not thinner than needed
    if n_layers <= 30:
        assert step == 1


def test_broken_and_model_granularity_variants_still_get_a_verdict():
    """NaN logits and infinite layer errors (a broken export) fail the bar without breaking the verdict; a
    variant without hidden states (model granularity: no embed error) is ranked from its K/V errors."""
    broken = _variant("broken", float("nan"), 0.1, [0.01, float("inf"), float("nan"), 0.2], INT4)
    whole = _variant("whole", 1e-3, 0.97, [0.002, 0.02, 0.021, 0.022], INT8)
    whole["per_layer"]["embed"] = None
    v = build_verdict(_report([broken, whole]), _facts({"broken": 500, "whole": 900}))
    assert v["ship"]["name"] == "whole" and not v["variants"][0]["passes"]
    assert "broken (0.00 MB: mean KL nan > 0.05, top-1 10 % < 90 %)" in v["text"]
    assert v["error"]["variant"] == "broken" and v["error"]["layers"][0]["layer"] == 1  # where it blew up
    alone = build_verdict(_report([whole]), _facts({"whole": 900}))
    # layer 0: 0.002 / floor 1e-3 = 2; layer 1: 0.02 / 0.002 = 10 -> layer 1, as int8: kept fp32
    assert [e["layer"] for e in alone["error"]["layers"]] == [1]
    assert "--keep 'layers.1.*'" in alone["fix"]["command"]


def test_no_command_when_there_is_nothing_to_change_and_fp32_errors_are_not_blamed_on_quantization():
    quiet = _variant("int8", 1e-6, 1.0, [1e-4] * 4, INT8)  # every layer below the floor
    v = build_verdict(_report([quiet]), _facts({"int8": 100}))
    assert v["ship"]["name"] == "int8" and v["error"]["layers"] == [] and v["fix"] is None
    assert "edgellm quantize" not in v["text"]
    broken = _variant("fp32", 0.3, 0.5, [1e-7, 0.4, 0.5, 0.5])
    v = build_verdict(_report([broken]), _facts({"fp32": 100}))
    assert v["ship"] is None and v["fix"] is None and v["error"]["layers"][0]["layer"] == 1
    assert "fp32 is fp32, so this is no quantization error" in v["text"] and "`" not in v["text"]


def test_exact_layers_get_no_fix_command():
    """Block minima that kept a grid (quantize --block-min): the layers that grow the error have weights with
    relative error 0, so more bits there cannot help: the verdict says where the error comes from instead."""
    report, facts = three_variants()
    exact = {k: 0.0 for k in ("layers.2.attn.qkv.weight", "layers.2.mlp.down.weight", "layers.0.mlp.down.weight")}
    facts["int4"]["weights"] = exact
    v = build_verdict(report, facts)
    assert v["fix"] is None and [e["layer"] for e in v["error"]["layers"]] == [2]
    assert "int4's weights in those layers come back exactly (rel. error 0)" in v["text"]
    assert "quantize again" not in v["text"]
