"""`edgellm quantize EXPORT -o DIR --bits 4|8`: weight-only int8/int4 quantization of an export directory.

Numbers are parsed by argparse (`type=integer`/`number`: a bad one is one line, exit 2); the allowed values of
each setting are checked by QuantizeOptions.validate, which names the flag.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgellm.runtime.errors import need

from . import integer, integers, number


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="int8/int4 weight quantization of an export (writes a new export directory)",
        description="Quantize the weights of every linear (fused qkv, o, gate_up, down, lm_head) and optionally "
                    "the embedding table of an fp32 export into a NEW export directory (the input is never "
                    "modified). Linears follow --bits/--group-size/--method; the lm_head and embeddings have "
                    "their own flags; --keep and --int8-layers mix precisions. Prints a per-weight table and "
                    "checks the logits against the fp32 export.")
    p.add_argument("export", type=Path, help="fp32 export directory (from `edgellm export`)")
    p.add_argument("-o", "--output", type=Path, required=True, help="quantized export directory to write")
    p.add_argument("--bits", type=integer, required=True, metavar="{4,8}", help="4 or 8: bits per linear weight")
    p.add_argument("--profile", default=None, choices=("balanced", "small"),
                   help="the settings of the flags not given (quant/profiles.py). balanced (default): llama.cpp "
                        "Q4_K_M's class - --bits 4 with block minima searched on calibration activations after "
                        "AWQ's scale migration, fp16 scales, the table and the 15 %% most sensitive linears int8 "
                        "(SmolLM2-135M: KL 0.0855 at 105.0 MB vs Q4_K_M 0.0884 at 105.5); small (--bits 4): Q4_0's "
                        "class, smaller and ~1.25x faster to decode - AWQ on symmetric blocks, 10 %% of the table's "
                        "rows int8 (KL 0.213 at 87.2 MB vs Q4_0 0.349 at 91.7)")
    p.add_argument("--group-size", type=integer, default=None, metavar="N",
                   help="weights per scale along the input dimension: 32, 64, 128 (also 16, 256), or 0 = one "
                        "scale per output channel (default: 32)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=True,
                     help="zero point fixed at the middle code (default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false",
                     help="a zero point per group: covers one-sided ranges, +1 byte per 2 (int4) / 1 (int8) groups")
    p.add_argument("--format", default="fast", metavar="{fast,portable}",
                   help="fast: com.microsoft MatMulNBits (onnxruntime); portable: standard DequantizeLinear + "
                        "MatMul (any ONNX runtime; onnxruntime fuses it into the same kernel). Default fast")
    p.add_argument("--method", default=None, metavar="{rtn,mse,awq,gptq}",
                   help="default: awq (with block minima: its scale migration, then the k-quant search; --bits 8: "
                        "rtn where the linears lie on llama.cpp grids). rtn: round to nearest; mse: per-group clip "
                        "search for the least squared error (with block minima: llama.cpp's k-quant search); awq: "
                        "activation-aware - AWQ's per-channel scale migration (into the RMSNorm "
                        "gains and up rows) and a clip search weighted by activations the fp32 export produces "
                        "on text it samples itself (int4); gptq: GPTQ's error-compensating rounding against each "
                        "linear's Hessian from the same calibration activations")
    p.add_argument("--embeddings", default="int8", metavar="{int8,fp32}", help="int8 (per row, default) or fp32")
    p.add_argument("--lm-head", default=None, metavar="{int8,int4,fp32}",
                   help="int8 (groups of 32; with --bits 4 only for --lm-head-int8-rows of its rows), int4 "
                        "(--group-size groups) or fp32; default int8. A tied lm_head and the embedding lookup "
                        "share one table")
    p.add_argument("--keep", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help='keep matching weights fp32: fnmatch on module paths, e.g. "layers.0.*" "lm_head" '
                        "(repeatable)")
    p.add_argument("--group", type=pattern_size, action="append", default=[], metavar="PATTERN=N",
                   help='block size N for the matmul weights PATTERN matches (fnmatch on module paths, as --keep), '
                        'whatever their bits, e.g. "layers.*.mlp.gate_up=64" (repeatable; first match wins)')
    p.add_argument("--int8-layers", type=integers, default=[], metavar="LIST",
                   help="with --bits 4: these layers' linears int8 (groups of 32), e.g. 0,-1 (first and last)")
    p.add_argument("--accuracy-level", type=integer, default=4, metavar="{0,1,4}",
                   help="MatMulNBits compute (fast format): 4 = int8 activations (fastest, default), "
                        "0/1 = fp32 activations")
    p.add_argument("--calibration-tokens", type=integer, default=512, metavar="N",
                   help="tokens the fp32 export samples for --method awq/gptq and --int8-fraction (default 512)")
    p.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="calibrate on the start of this UTF-8 text (tokenized by the export's tokenizer; "
                        "--calibration-tokens of it) instead of text the export samples itself: use text like "
                        "your users'")
    p.add_argument("--act-order", action="store_true",
                   help="--method gptq: quantize columns in order of decreasing activation energy")
    p.add_argument("--int8-fraction", type=number, default=None, metavar="F",
                   help="--bits 4: about this fraction of the linears' weights int8, the most sensitive ones as "
                        "measured on calibration data (default 0.15; 0 with --profile small or where "
                        "--block-min auto keeps the linears' grids)")
    p.add_argument("--lm-head-int8-rows", type=number, default=None, metavar="F",
                   help="--bits 4, int8 lm_head: only this fraction of its vocabulary rows int8, those carrying "
                        "the probability on calibration text; the rest int4 (default 1: every row int8; --profile small "
                        "0.1; 0.45 where --block-min auto keeps the linears' grids)")
    p.add_argument("--kv-dtype", default=None, choices=("auto", "float32", "float16", "int8"),
                   help="the KV cache's type. auto (default): float16 where the export holds one (a fused export "
                        "with a float32 cache) and its --max-seq is >= 1536 (half the bytes, quality within noise; "
                        "onnxruntime's CPU attention is slower on fp16 rows, which pays only past ~700 rows of "
                        "context), else the export's. float16: always where it can. "
                        "float32: keep the export's fp32 cache. int8: a quarter of fp32's bytes (static "
                        "per-channel scales calibrated on --calibration-tokens of sampled text, or "
                        "--calibration-text; runs on onnxruntime >= 1.27): faster plain decoding, slower "
                        "speculative verification (docs/quantization.md)")
    p.add_argument("--scales-dtype", default=None, choices=("auto", "float16", "float32"),
                   help="how the fast format stores the weights' block scales (their values are fp16-rounded "
                        "either way); default float16 for --bits 4 on float weights (Q4_K's bytes), else auto. "
                        "auto: float32 for 4-bit weights (+0.5 bit per weight on disk; the "
                        "runtime drops them from RAM once packed, where onnxruntime keeps a float32 copy of fp16 "
                        "ones: SmolLM2-135M int4 -15 MB peak RSS), float16 for 8-bit ones (Q8_0's 8.5 bits per weight)")
    p.add_argument("--block-min", default=None, choices=("auto", "on", "off"),
                   help="4-bit linears with a float offset beside each block's scale, llama.cpp Q4_1's layout: "
                        "+1 bit per weight (+0.5 with --scales-dtype float16), decode ~0.8x (SmolLM2-135M). auto "
                        "(default): where every linear already lies on a llama.cpp grid (a model converted from a "
                        "4-bit GGUF: Q4_0, Q4_1, a Q4_K_M mix), each is kept exactly on its own (4-bit, with offsets "
                        "where it has them; its Q5_0/Q6_K/Q8_0 tensors int8) and 45 %% of the table's rows int8 "
                        "(--profile small: its 10 %%; --bits 8: rounded to nearest instead of AWQ); on float weights the profile's (balanced: "
                        "on, small: off). on: offsets for any weights (--method rtn: each block's min..max; mse/awq: "
                        "llama.cpp's k-quant search of step and offset, weighted by calibration activations); off: "
                        "never, and no grid kept")
    p.add_argument("--kl-budget", type=number, default=None, metavar="X",
                   help="the smallest variant whose measured mean KL vs fp32 is <= X (tries a ladder of "
                        "settings from small to large, each with the small profile's other settings; --bits picks the "
                        "method's ladder start)")
    p.add_argument("--seed", type=integer, default=0, metavar="N", help="seed of the sampled calibration/check text (default 0)")
    p.add_argument("--no-check", action="store_true", help="skip the logits check against the fp32 export")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def pattern_size(text: str) -> tuple[str, int]:
    """argparse `type=` of --group: "PATTERN=N" -> (PATTERN, N)."""
    pattern, _, size = text.rpartition("=")
    try:
        return pattern, int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PATTERN=N (N an integer), got {text!r}") from None


def options_from_args(args: argparse.Namespace):
    from edgellm.quant.options import QuantizeOptions
    from edgellm.quant.profiles import defaults

    need(args.profile is None or args.kl_budget is None,
         "--profile: not with --kl-budget (its ladder picks the settings, from the small profile's)")
    profile = args.profile or ("small" if args.kl_budget is not None else "balanced")
    flags = {"method": args.method, "scales_dtype": args.scales_dtype, "lm_head": args.lm_head,
             "head_int8_rows": args.lm_head_int8_rows, "int8_fraction": args.int8_fraction,
             "kv_dtype": args.kv_dtype, "block_min": None if args.block_min == "auto" else args.block_min}
    given = {k: v for k, v in flags.items() if v is not None}
    need(args.bits in (4, 8), f"--bits: expected 4 or 8, got {args.bits}")
    chosen, on_grids = defaults(args.bits, profile, given, args.format, args.symmetric, args.group_size)
    options = QuantizeOptions(
        bits=args.bits, group_size=args.group_size, symmetric=args.symmetric, format=args.format,
        embeddings=args.embeddings, keep=tuple(args.keep), int8_layers=tuple(dict.fromkeys(args.int8_layers)),
        accuracy_level=args.accuracy_level, calibration_tokens=args.calibration_tokens, seed=args.seed,
        act_order=args.act_order, groups=tuple(args.group), calibration_text=args.calibration_text,
        keep_grids=args.block_min in (None, "auto"), on_grids=on_grids, **chosen)
    options.validate()
    need(options.seed >= 0, f"--seed: expected an integer >= 0, got {options.seed}")
    return options


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)            # flags first: no onnx import for a typo
    from edgellm.quant.export_dir import quantize_export
    from edgellm.quant.report import weight_table

    if args.kl_budget is not None:
        need(not args.no_check, "--kl-budget: measures each variant's KL, so it cannot run with --no-check")
        from edgellm.quant.budget import smallest_within

        result, _ = smallest_within(args.export, args.output, options, args.kl_budget,
                                    progress=not args.no_progress)
    else:
        result = quantize_export(args.export, args.output, options, check=not args.no_check,
                                 progress=not args.no_progress)
    for line in weight_table(result.weights):
        print(line)
    b, a = result.files_before, result.files_after
    print(f"export size: {b / 1e6:.2f} MB -> {a / 1e6:.2f} MB ({a / b:.3f}x)")
    if result.check is not None:
        c = result.check
        print(f"check vs fp32 ({c.positions} sampled positions): top-1 agreement {c.top1_agreement:.1%}, "
              f"mean KL {c.mean_kl:.2e}, max |logit diff| {c.max_abs_diff:.3g}")
    from .info_export import next_step

    print("wrote " + next_step(args.output, result.manifest, f" ({a / b:.2f}x of {args.export})", args.export))
    return 0
