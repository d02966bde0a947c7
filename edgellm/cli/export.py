"""`edgellm export CHECKPOINT -o DIR`: static-KV ONNX graphs + manifest.json, verified against PyTorch."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

from . import integer, number

DEFAULT_MAX_SEQ = 512


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export", help="export a checkpoint to ONNX graphs with a static KV cache (verified)",
        description="Export a checkpoint to ONNX: embed/layer/head graphs (or one model graph), each at "
                    "S = --prefill-chunk and S = 1, with a static KV cache of --max-seq rows. Every graph is "
                    "checked against PyTorch in onnxruntime. An interrupted export resumes from DIR.partial.")
    parser.add_argument("checkpoint", type=Path, help="HF directory, .gguf file (llama.cpp), llama2.c .bin file or edgellm checkpoint dir")
    parser.add_argument("-o", "--output", type=Path, required=True, help="export directory to write")
    parser.add_argument("--max-seq", type=integer, default=None,
                        help=f"context length of the static KV cache (default {DEFAULT_MAX_SEQ}, or the model's "
                             "max_seq_len if smaller)")
    parser.add_argument("--prefill-chunk", type=integer, default=32, help="tokens per prefill graph call (default 32)")
    parser.add_argument("--granularity", choices=("layer", "model"), default="layer",
                        help="layer: embed + one graph per layer + head (default); model: one graph")
    parser.add_argument("--attention", choices=("fused", "standard"), default="fused",
                        help="fused: layers built from onnxruntime's fused CPU kernels (GroupQueryAttention, "
                             "SkipSimplifiedLayerNormalization), the cache written in place (default, fastest); "
                             "standard: plain ONNX ops only, for toolchains without com.microsoft ops "
                             "(granularity model is always standard). Fused layers take any head size: "
                             "one that is no multiple of 8 is zero-padded to the next (manifest kv_head_dim)")
    parser.add_argument("--kv-dtype", choices=("float32", "float16"), default="float32",
                        help="the KV cache's element type: float16 halves its bytes (fused layers, full attention "
                             "only; default float32). int8: `edgellm quantize --kv-dtype int8` (calibrated scales)")
    parser.add_argument("--sliding-cache", choices=("ring", "full"), default="ring",
                        help="sliding-window layers (Gemma 3): ring keeps only the rows a window reaches (default; "
                             "a window covering --max-seq makes a full layer anyway); full gives them full-length "
                             "caches attended by the fused kernel: faster decode, a longer cache, fp16-capable")
    parser.add_argument("--atol", type=number, default=1e-4,
                        help="max |onnxruntime - PyTorch| allowed on any output, relative to the output's scale "
                             "max(1, max |PyTorch|) (default 1e-4; with --kv-dtype float16 at least 4e-3)")
    parser.add_argument("--opset", type=integer, default=20, help="ONNX opset, 18..21 (default 20)")
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="the chat template to ship for `edgellm run --chat`: a Jinja file or a "
                             "tokenizer_config.json (default: the one beside the checkpoint's tokenizer.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgellm.export import ExportOptions, export_model  # torch/onnx only when the verb runs
    from edgellm.export.bos_rule import checkpoint_add_bos
    from edgellm.loaders import load_checkpoint

    # the flags are checked before the (possibly slow) load; the model's own limits after it
    max_seq = args.max_seq if args.max_seq is not None else DEFAULT_MAX_SEQ
    options = ExportOptions(max_seq=max_seq, prefill_chunk=args.prefill_chunk, granularity=args.granularity,
                            attention=args.attention, atol=args.atol, opset=args.opset, kv_dtype=args.kv_dtype,
                            sliding_cache=args.sliding_cache)
    options.validate()
    # lazy: the weights stay in the checkpoint file and each unit reads its own, so a model larger than
    # memory as float32 still exports (peak ~ the largest unit plus the runtime check, not the whole model)
    loaded = load_checkpoint(args.checkpoint, lazy=True)
    with loaded.weights or contextlib.nullcontext():
        if args.max_seq is None and loaded.config.max_seq_len < max_seq:
            options = dataclasses.replace(options, max_seq=loaded.config.max_seq_len)
        add_bos = checkpoint_add_bos(loaded.source, loaded.tokenizer_path, loaded.config.bos_id)
        export_model(loaded.model, args.output, options, loaded.tokenizer_path, progress=not args.no_progress,
                     chat_template=args.chat_template, add_bos=add_bos, weights=loaded.weights)
    return 0
