"""`edgellm train`: train a decoder on text (or token) files into a native checkpoint directory.

The same command runs data-parallel under `torchrun --nproc_per_node N -m edgellm train ...`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import integer, number

# flag -> TrainConfig field (flags left unset keep the config file's or the checkpoint's value)
TRAIN_FLAGS = {
    "--steps": ("steps", integer), "--batch-size": ("batch_size", integer), "--seq-len": ("seq_len", integer),
    "--lr": ("lr", number), "--min-lr": ("min_lr", number), "--warmup": ("warmup", integer),
    "--grad-accum": ("grad_accum", integer), "--clip": ("clip", number), "--weight-decay": ("weight_decay", number),
    "--eval-every": ("eval_every", integer), "--eval-steps": ("eval_steps", integer),
    "--save-every": ("save_every", integer), "--seed": ("seed", integer), "--val-fraction": ("val_fraction", number),
    "--time-budget": ("time_budget_s", number), "--threads": ("threads", integer),
}
SIZE_FLAGS = {"--dim": "dim", "--n-layers": "n_layers", "--n-heads": "n_heads", "--n-kv-heads": "n_kv_heads",
              "--hidden-dim": "hidden_dim", "--max-seq-len": "max_seq_len"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a decoder on text files into a native checkpoint",
                       description=__doc__)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", help="architecture preset (llama2, qwen3, ...), sized by the flags below")
    model.add_argument("--config", type=Path, help="JSON of ModelConfig fields, optionally with a 'train' "
                                                   "object of training fields")
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="UTF-8 text files (documents split at blank lines) or token files (.npy, .bin)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", type=Path, help="tokenizer.json to tokenize the text with")
    tok.add_argument("--vocab-size", type=integer, help="train a byte-level BPE of this size on the text first")
    p.add_argument("-o", "--output", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in -o exactly")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for flag, (field, kind) in TRAIN_FLAGS.items():
        p.add_argument(flag, type=kind, default=None, dest=field)
    sizes = p.add_argument_group("model size (overrides the preset or config)")
    for flag, field in SIZE_FLAGS.items():
        sizes.add_argument(flag, type=integer, default=None, dest=field)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgellm.model import PRESETS
    from edgellm.runtime.errors import need
    from edgellm.train import ddp
    from edgellm.train.checkpoint import DATA_DIR, is_complete, recover
    from edgellm.train.data import open_token_file
    from edgellm.train.loop import train

    d = ddp.setup()
    out: Path = args.output
    for path in args.data:
        need(path.is_file(), f"--data {path}: file not found")
    train_overrides = {field: getattr(args, field) for field, _ in TRAIN_FLAGS.values()
                       if getattr(args, field) is not None}
    sizes = {field: getattr(args, field) for field in SIZE_FLAGS.values() if getattr(args, field) is not None}
    if args.resume:
        need(args.preset is None and args.config is None and not sizes and args.vocab_size is None
             and args.tokenizer is None, "--resume takes the model and tokenizer from -o; drop --preset/--config/"
                                         "size/--tokenizer/--vocab-size flags")
        if d.main:
            recover(out)
        ddp.barrier(d)
        model_cfg, cfg, tok_path = _from_checkpoint(out, train_overrides)
    else:
        need(args.preset is not None or args.config is not None, "give --preset NAME or --config FILE.json")
        need(args.preset is None or args.preset in PRESETS,
             f"--preset {args.preset}: unknown preset; expected one of {', '.join(PRESETS)}")
        need(not is_complete(out), f"-o {out}: already holds a training checkpoint; pass --resume to continue "
                                   "it or choose another -o")
        tok_path = _prepare_tokenizer(args, out) if d.main else None
        tok_path = ddp.broadcast(d, tok_path)
        model_cfg, cfg = _fresh_configs(args, sizes, train_overrides, tok_path)

    token_file = out / DATA_DIR / "tokens.bin"
    if d.main:
        data = _tokenize(args.data, token_file, model_cfg.vocab_size, tok_path)
    ddp.barrier(d)
    if not d.main:
        data = open_token_file(token_file)
    result = train(cfg, model_cfg, data, out, resume=args.resume, progress=not args.quiet)
    if d.main:
        print(result.summary())
    ddp.barrier(d)  # both ranks leave together: a rank that destroyed its group while the other was still in a
    ddp.teardown()  # collective aborted once ("terminate called without an active exception", CI 2026-11-27)
    return 0


def _prepare_tokenizer(args: argparse.Namespace, out: Path) -> Path | None:
    """Put the run's tokenizer at OUT/tokenizer.json: copied from --tokenizer, or trained (--vocab-size)."""
    import shutil

    from edgellm.runtime.errors import need
    from edgellm.runtime.tokenizer import load_tokenizer
    from edgellm.train.bpe import train_bpe

    dest = out / "tokenizer.json"
    if args.tokenizer is not None:
        need(args.tokenizer.suffix == ".json", f"--tokenizer {args.tokenizer}: expected a tokenizer.json")
        load_tokenizer(args.tokenizer)  # reject a broken file before anything trains
        out.mkdir(parents=True, exist_ok=True)  # only now: a failed check leaves no empty -o behind
        if args.tokenizer.resolve() != dest.resolve():
            shutil.copyfile(args.tokenizer, dest)
        return dest
    if args.vocab_size is not None:
        texts = [p for p in args.data if p.suffix not in (".npy", ".bin")]
        need(len(texts) > 0, "--vocab-size: trains a tokenizer on text, but every --data file is pre-tokenized")
        tok = train_bpe(texts, args.vocab_size, dest)
        print(f"trained a {tok.vocab_size}-token BPE on {len(texts)} file(s) -> {dest}")
        return dest
    return None


def _fresh_configs(args: argparse.Namespace, sizes: dict[str, int], overrides: dict[str, Any],
                   tok_path: Path | None) -> tuple[Any, Any]:
    from edgellm.model import ModelConfig
    from edgellm.runtime.errors import EdgeError, need
    from edgellm.runtime.tokenizer import load_tokenizer
    from edgellm.train.loop import TrainConfig

    tok = load_tokenizer(tok_path) if tok_path is not None else None
    vocab = {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id} if tok else {}
    train_data: dict[str, Any] = {}
    if args.config is not None:
        data = _read_json(args.config)
        train_data = data.pop("train", {})
        need(isinstance(train_data, dict), f"--config {args.config}: 'train' must be an object")
        if tok is not None and "vocab_size" in data:
            need(data["vocab_size"] >= tok.vocab_size, f"--config {args.config}: vocab_size {data['vocab_size']} "
                 f"is smaller than the tokenizer's {tok.vocab_size}")
            vocab.pop("vocab_size")
        need("vocab_size" in data or tok is not None,
             f"--config {args.config}: no vocab_size and no tokenizer (give --tokenizer or --vocab-size)")
        try:
            model_cfg = ModelConfig.from_dict({**data, **vocab, **sizes})
            cfg = TrainConfig.from_dict({**train_data, **overrides})
        except (EdgeError, TypeError) as exc:
            raise EdgeError(f"--config {args.config}: {exc}") from None
        return model_cfg, cfg
    need(tok is not None, f"--preset {args.preset}: the model's vocabulary comes from a tokenizer; give "
                          "--tokenizer or --vocab-size (or a --config with vocab_size for token files)")
    return ModelConfig.preset_config(args.preset, **vocab, **sizes), TrainConfig.from_dict(overrides)


def _from_checkpoint(out: Path, overrides: dict[str, Any]) -> tuple[Any, Any, Path | None]:
    from edgellm.model import ModelConfig
    from edgellm.train.checkpoint import TOKENIZER, load
    from edgellm.train.loop import TrainConfig

    state, _ = load(out)
    cfg = TrainConfig.from_dict({**state["train_config"], **overrides})
    tok = out / TOKENIZER
    return ModelConfig.from_dict(state["model_config"]), cfg, tok if tok.is_file() else None


def _tokenize(files: list[Path], token_file: Path, vocab_size: int, tok_path: Path | None) -> Any:
    """Tokenize --data once into OUT/data/tokens.bin (reused when the sources and tokenizer are unchanged)."""
    from edgellm.runtime.tokenizer import load_tokenizer
    from edgellm.train.data import build_token_file, file_sha256

    tok = load_tokenizer(tok_path) if tok_path is not None else None
    return build_token_file(files, token_file, vocab_size, tok, file_sha256(tok_path) if tok_path else None)


def _read_json(path: Path) -> dict[str, Any]:
    from edgellm.runtime.errors import EdgeError, need

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise EdgeError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgeError(f"{path}: not readable JSON ({exc})") from None
    need(isinstance(data, dict), f"{path}: expected a JSON object")
    return data
