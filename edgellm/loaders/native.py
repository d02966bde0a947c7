"""edgellm's own checkpoint directory (format "edgellm-checkpoint", format_version 1).

```
edgellm.json             {"format", "format_version", "edgellm_version", "config": ModelConfig.to_dict(),
                          "weights": "model.safetensors", "tokenizer": "tokenizer.json" | "tokenizer.bin" | null,
                          "extra_state": "extra_state.json" | null}
model.safetensors        the state dict under the docs/design.md names, as saved (float32 from training)
tokenizer.json|.bin      optional copy of the tokenizer
extra_state.json (+ extra_state.safetensors)   optional training state (optimizer, step, ...), see extra_state
```
A checkpoint is written into a temporary sibling directory and renamed into place (runtime.fileio.atomic_dir),
so a crash mid-save leaves the previous checkpoint intact. The reader rejects other formats, other versions,
unknown top-level keys and unknown config keys.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from edgellm import __version__
from edgellm.model import Decoder, ModelConfig
from edgellm.runtime.errors import EdgeError, need
from edgellm.runtime.fileio import atomic_dir, safe_join

from .extra_state import TREE_FILE, read_extra_state, write_extra_state
from .lazy import model_or_weights
from .loaded import Loaded
from .tensors import TensorSource, check_plan, meta_decoder, shapes

FORMAT, VERSION = "edgellm-checkpoint", 1
MARKER, WEIGHTS = "edgellm.json", "model.safetensors"
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.bin")
KEYS = {"format", "format_version", "edgellm_version", "config", "weights", "tokenizer", "extra_state"}


def is_native_dir(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def save_checkpoint(model: Decoder, directory: Path, extra_state: dict[str, Any] | None = None,
                    tokenizer: Path | None = None) -> Path:
    """Write `model` (+ optional training state and tokenizer copy) as a native checkpoint at `directory`.

    An existing checkpoint there is replaced atomically; any other non-empty directory is refused.
    """
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper saves its inner module
    need(isinstance(model, Decoder), f"save_checkpoint needs an edgellm Decoder, got {type(model).__name__}")
    directory = Path(directory)
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        need(tokenizer.is_file() and tokenizer.name in TOKENIZER_NAMES,
             f"{tokenizer}: expected an existing {' or '.join(TOKENIZER_NAMES)}")
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()  # an empty directory (e.g. made by the caller) is as good as none
    with atomic_dir(directory, marker=MARKER) as tmp:
        state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "edgellm": FORMAT})
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / tokenizer.name)
        if extra_state is not None:
            write_extra_state(tmp, extra_state)
        doc = {"format": FORMAT, "format_version": VERSION, "edgellm_version": __version__,
               "config": model.cfg.to_dict(), "weights": WEIGHTS,
               "tokenizer": tokenizer.name if tokenizer is not None else None,
               "extra_state": TREE_FILE if extra_state is not None else None}
        (tmp / MARKER).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        for path in tmp.iterdir():  # data on disk before the rename makes the checkpoint visible
            _fsync(path)
    return directory


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(directory: Path) -> tuple[dict[str, Any], ModelConfig]:
    """edgellm.json, validated, and the config it holds."""
    path = directory / MARKER
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EdgeError(f"{path}: not readable JSON ({exc})") from None
    need(isinstance(doc, dict) and doc.get("format") == FORMAT,
         f"{path}: format is {doc.get('format') if isinstance(doc, dict) else None!r}; expected {FORMAT!r}")
    need(doc.get("format_version") == VERSION, f"{path}: format_version {doc.get('format_version')!r} is not "
         f"supported (this edgellm {__version__} reads {VERSION})")
    unknown = sorted(set(doc) - KEYS)
    need(not unknown, f"{path}: unknown keys {', '.join(unknown)} (expected {', '.join(sorted(KEYS))})")
    need(doc.get("weights") == WEIGHTS, f"{path}: weights must be {WEIGHTS!r}, got {doc.get('weights')!r}")
    need(isinstance(doc.get("config"), dict), f"{path}: config must be an object")
    try:
        cfg = ModelConfig.from_dict(doc["config"])
    except (EdgeError, TypeError, ValueError) as exc:
        raise EdgeError(f"{path}: bad config: {exc}") from None
    return doc, cfg


def load_native(directory: Path, lazy: bool = False) -> Loaded:
    """The checkpoint in `directory`; `lazy` as for `load_hf`."""
    directory = Path(directory)
    doc, cfg = read_marker(directory)
    weights = directory / WEIGHTS
    need(weights.is_file(), f"{weights}: missing (the checkpoint's weights)")
    tokenizer = None
    if doc.get("tokenizer") is not None:
        need(doc["tokenizer"] in TOKENIZER_NAMES, f"{directory / MARKER}: tokenizer must be one of "
             f"{', '.join(TOKENIZER_NAMES)} or null, got {doc['tokenizer']!r}")
        tokenizer = safe_join(directory, doc["tokenizer"])
        need(tokenizer.is_file(), f"{tokenizer}: missing (named by {MARKER})")
    source = TensorSource([weights])
    try:
        meta = meta_decoder(cfg)
        plan = {name: (name,) for name in meta.state_dict()}
        check_plan(shapes(meta), plan, source, str(weights))
        model, lazy_weights = model_or_weights(meta, plan, source, lazy)
    except BaseException:
        source.close()
        raise
    return Loaded(model, cfg, tokenizer, "edgellm", lazy_weights)


def load_extra_state(directory: Path) -> dict[str, Any] | None:
    """The training state saved with a native checkpoint, or None if it has none."""
    directory = Path(directory)
    doc, _ = read_marker(directory)
    if doc.get("extra_state") is None:
        return None
    need(doc["extra_state"] == TREE_FILE, f"{directory / MARKER}: extra_state must be {TREE_FILE!r} or null")
    return read_extra_state(directory)
