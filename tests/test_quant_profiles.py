"""`edgellm quantize --profile` (quant/profiles.py): the settings of the flags a user does not give, for float weights
and where `--block-min auto` keeps the linears' llama.cpp grids (`on_grids`), and a flag given winning over both."""

from __future__ import annotations

from edgellm.cli import build_parser
from edgellm.cli.quantize import options_from_args


def opts(*flags: str):
    return options_from_args(build_parser().parse_args(["quantize", "x", "-o", "y", *flags]))


def test_cli_defaults_per_profile() -> None:
    """quant/profiles.py: --bits 4 balanced (AWQ + k-quant block minima, fp16 scales, table int8, 15 % int8), small (AWQ,
    10 % of the table's rows int8), --bits 8 AWQ; all keep grids (`--block-min auto`) with their on-grid settings
    for the flags not given; a flag given wins, and where block minima cannot be, the profile's linears are
    symmetric blocks."""
    b4, s4, o8 = opts("--bits", "4"), opts("--bits", "4", "--profile", "small"), opts("--bits", "8")
    fields = ("method", "block_min", "scales_dtype", "head", "head_int8_rows", "int8_fraction", "group", "keep_grids")
    assert tuple(getattr(b4, f) for f in fields) == ("awq", "on", "float16", "int8", 1.0, 0.15, 32, True)
    assert tuple(getattr(s4, f) for f in fields) == ("awq", "off", "auto", "int8", 0.1, 0.0, 32, True)
    assert tuple(getattr(o8, f) for f in fields) == ("awq", "off", "auto", "int8", 1.0, 0.0, 32, True)
    assert dict(b4.on_grids) == {"head_int8_rows": 0.45, "int8_fraction": 0.0, "scales_dtype": "auto"}
    # small stays Q4_0's class on a grid too: its scales stored float16 (the default's size with float32 ones), and
    # the speed setting's 10 % of the table's rows int8 (the head's bytes are much of a decode step's)
    assert dict(s4.on_grids) == {"int8_fraction": 0.0, "scales_dtype": "float16"}
    assert dict(o8.on_grids) == {"method": "rtn"} and opts("--bits", "8", "--method", "rtn").on_grids == ()
    given = opts("--bits", "4", "--int8-fraction", "0.2", "--lm-head-int8-rows", "0.5", "--scales-dtype", "float32")
    assert (given.int8_fraction, given.head_int8_rows, given.scales_dtype, given.on_grids) == (0.2, 0.5, "float32", ())
    for flags in (["--format", "portable"], ["--asymmetric"], ["--group-size", "0"], ["--method", "gptq"],
                  ["--method", "rtn"], ["--block-min", "off"]):
        o = opts("--bits", "4", *flags)
        assert o.block_min == "off" and o.keep_grids == (flags != ["--block-min", "off"]), flags
        assert o.method == (flags[1] if flags[0] == "--method" else "awq"), flags   # symmetric: AWQ unless given
    assert opts("--bits", "4", "--format", "portable").head_int8_rows == 1.0
    assert opts("--bits", "4", "--profile", "small", "--format", "portable").on_grids == (
        ("int8_fraction", 0.0), ("scales_dtype", "float16"))       # no head to split: its rows are not set on grids
    assert opts("--bits", "4", "--profile", "small", "--block-min", "on").method == "awq"
    small = opts("--bits", "4", "--int8-fraction", "0", "--method", "rtn", "--lm-head", "int4")
    assert (small.method, small.head, small.int8_fraction, small.head_int8_rows) == ("rtn", "int4", 0.0, 1.0)
    assert (b4.groups, opts("--bits", "8", "--group", "layers.*.attn.o=64", "--group", "lm_head=0").groups) == \
        ((), (("layers.*.attn.o", 64), ("lm_head", 0)))
