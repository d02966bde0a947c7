"""`edgellm info PATH`: what a checkpoint is (source, preset, config), how many parameters, how big; or, for an
export directory, what it holds and what `edgellm run` will execute (info_export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("info", help="describe a checkpoint (HF dir, .gguf, llama2.c .bin, edgellm dir) or an export",
                            description="Load a checkpoint and print its source, preset, config, parameter "
                                        "count and sizes; or describe an export directory from its manifest "
                                        "(layout, precision, graphs run per token, sizes, checks).")
    parser.add_argument("checkpoint", type=Path,
                        help="HF directory, .gguf file, llama2.c .bin file, edgellm checkpoint dir, or an export dir")
    parser.set_defaults(func=run)


def _disk_bytes(path: Path) -> int:
    """The checkpoint file, or the regular files directly inside a checkpoint directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _value(value: object) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 6:  # LongRoPE factors, Gemma 3's layer types: the ends
        def one(v: object) -> str:
            return f"{v:g}" if isinstance(v, float) else str(v)
        head = ", ".join(one(v) for v in value[:3])
        tail = ", ".join(one(v) for v in value[-2:])
        return f"[{head}, ..., {tail}] ({len(value)} values)"
    return str(value)


def run(args: argparse.Namespace) -> int:
    from .info_export import describe_export, is_export

    if is_export(args.checkpoint):
        describe_export(args.checkpoint)
        return 0
    from edgellm.loaders import load_checkpoint  # torch is imported only when the verb runs

    loaded = load_checkpoint(args.checkpoint)
    cfg = loaded.config
    n_params = sum(p.numel() for p in loaded.model.parameters())
    print(f"checkpoint: {args.checkpoint}")
    print(f"source: {loaded.source}")
    print(f"preset: {cfg.preset}")
    print("config:")
    for key, value in cfg.to_dict().items():
        print(f"  {key}: {_value(value)}")
    print(f"parameters: {n_params}")
    print(f"size fp32: {n_params * 4 / 1e6:.2f} MB")
    print(f"size on disk: {_disk_bytes(args.checkpoint) / 1e6:.2f} MB")
    from edgellm.export.bos_rule import checkpoint_add_bos
    from edgellm.runtime.errors import EdgeError

    rule = ""
    if loaded.tokenizer_path is not None:
        try:
            bos = checkpoint_add_bos(loaded.source, loaded.tokenizer_path, cfg.bos_id)
            rule = f" (BOS {'put' if bos else 'not put'} in front of text prompts)"
        except EdgeError as err:  # export would refuse it; info still describes the checkpoint
            rule = f" (BOS rule: {err})"
    print(f"tokenizer: {loaded.tokenizer_path or 'none'}{rule}")
    if loaded.source == "gguf":
        from edgellm.loaders.gguf import describe

        for line in describe(cfg.extra):
            print(line)
    return 0
