"""The `edgellm quantize` command a report's verdict suggests (diff/verdict.py): the variant's recorded options
repeated flag by flag, whatever today's defaults and profiles would pick, plus the fix for the layers carrying the
error; and that change in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# `edgellm quantize` flags whose defaults do not depend on the profile: equal to these, left out of commands
_DEFAULTS = {"symmetric": True, "format": "fast", "method": "rtn", "embeddings": "int8", "accuracy_level": 4,
             "calibration_tokens": 512, "seed": 0}


def quantize_argv(source: str, out: str, options: dict[str, Any], fix_layers: list[int]) -> list[str]:
    """`edgellm quantize` argv repeating the variant's recorded options, plus the fix for `fix_layers`."""
    bits = int(options.get("bits", 4))
    argv = ["edgellm", "quantize", source, "-o", out, "--bits", str(bits)]
    group = options.get("group_size")
    if group is not None and group != (32 if bits == 4 else 0):
        argv += ["--group-size", str(group)]
    if options.get("symmetric", True) is False:
        argv.append("--asymmetric")
    for key in ("format", "embeddings"):
        if options.get(key, _DEFAULTS[key]) != _DEFAULTS[key]:
            argv += [f"--{key}", str(options[key])]
    # what the CLI's profile would pick depends on the source's weights and the profile (quant/profiles.py), so
    # the settings it picks are repeated as recorded; method "grid" is `--block-min auto`'s finding, found again
    method = str(options.get("method", _DEFAULTS["method"]))
    if method != "grid":
        argv += ["--method", method]
        if bits == 4:
            argv += ["--block-min", str(options.get("block_min", "off"))]
    if bits == 4:
        argv += ["--int8-fraction", f"{float(options.get('int8_fraction', 0.0)):g}"]
    head = options.get("lm_head") or ("int4" if bits == 4 else "int8")
    # an int8 head keeps its rows as they were (a manifest from before `--lm-head-int8-rows`: every row int8)
    rows = float(options.get("head_int8_rows", 1.0)) if head == "int8" else None
    if head == "int4":
        head = "int8"  # the fix: the largest single matrix, and int4's biggest KL source
    if head != ("int4" if bits == 4 else "int8"):
        argv += ["--lm-head", head]
    if rows is not None and bits == 4:     # as recorded (an int4 head made int8 takes the CLI's default)
        argv += ["--lm-head-int8-rows", f"{rows:g}"]
    if options.get("kv_dtype"):
        argv += ["--kv-dtype", str(options["kv_dtype"])]
    scales = options.get("scales_dtype", "auto")     # "auto" before --scales-dtype was recorded
    if bits == 4 or scales != "auto":
        argv += ["--scales-dtype", str(scales)]
    keep = list(options.get("keep") or [])
    int8 = [int(i) for i in options.get("int8_layers") or []]
    for layer in fix_layers:
        if bits == 4 and layer not in int8:
            int8.append(layer)
        elif f"layers.{layer}.*" not in keep:
            keep.append(f"layers.{layer}.*")  # int8 already: only fp32 is left
    if keep:
        argv += ["--keep", *keep]
    if int8:
        argv += ["--int8-layers", ",".join(map(str, int8))]
    for key, flag in (("accuracy_level", "--accuracy-level"), ("calibration_tokens", "--calibration-tokens"),
                      ("seed", "--seed")):
        if options.get(key) is not None and options[key] != _DEFAULTS[key]:
            if key != "accuracy_level" or options.get("format", "fast") == "fast":
                argv += [flag, str(options[key])]
    return argv


def change_words(options: dict[str, Any], layers: list[int]) -> str:
    """What `quantize_argv` changed, in words."""
    bits = int(options.get("bits", 4))
    int8 = {int(i) for i in options.get("int8_layers") or []}
    words = []
    to_int8 = [n for n in layers if bits == 4 and n not in int8]
    to_fp32 = [n for n in layers if n not in to_int8]
    if to_int8:
        words.append(f"int8 linears in layer{'s' if len(to_int8) > 1 else ''} {', '.join(map(str, to_int8))}")
    if to_fp32:
        words.append(f"layer{'s' if len(to_fp32) > 1 else ''} {', '.join(map(str, to_fp32))} kept fp32")
    if (options.get("lm_head") or ("int4" if bits == 4 else "int8")) == "int4":
        words.append("an int8 lm_head")
    return ", ".join(words) or "the same options"


def free_path(base: str) -> str:
    """`base`, or base2, base3 ... : a directory the suggested command will not overwrite."""
    n, path = 1, base
    while Path(path).exists():
        n += 1
        path = f"{base}{n}"
    return path
