"""Training checkpoints: the output directory IS an edgellm native checkpoint that can be resumed.

```
OUT/
  edgellm.json, model.safetensors, tokenizer.json     edgellm.loaders.save_checkpoint (what export reads)
  extra_state.json (+ .safetensors)                    the train state (below), via the same call
  data/tokens.bin, data/tokens.json                    the token cache (hard-linked from one save to the next)
```
Train state (format `edgellm-train-state`, version 1): step, per-step losses, evaluations, the window
sampler's numpy state, every rank's torch RNG state, the AdamW state_dict, train and model configs.

A save builds the complete new directory beside OUT (`OUT.tmp`), then swaps: OUT -> `OUT.old`,
`OUT.tmp` -> OUT, delete `OUT.old`. `recover` repairs a run killed anywhere in between: OUT missing while
`OUT.old` exists means `OUT.tmp` was finished (it is renamed only when complete).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgellm.runtime.errors import need

STATE_FORMAT = "edgellm-train-state"
STATE_VERSION = 1
DATA_DIR = "data"
TOKENIZER = "tokenizer.json"


def _staging(out: Path) -> Path:
    return out.with_name(out.name + ".tmp")


def _old(out: Path) -> Path:
    return out.with_name(out.name + ".old")


def is_complete(path: Path) -> bool:
    """True if `path` holds a resumable training checkpoint."""
    return (path / "edgellm.json").is_file() and (path / "extra_state.json").is_file()


def recover(out: Path) -> None:
    """Finish or undo a swap a killed run left half done, so `out` is the last complete checkpoint."""
    tmp, old = _staging(out), _old(out)
    if not out.exists() and old.exists():
        (tmp if tmp.is_dir() else old).rename(out)  # killed between the renames: tmp was complete
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)


def save(out: Path, model: nn.Module, state: dict[str, Any]) -> None:
    """Write `model` + the train `state` (may hold tensors) as the checkpoint `out`, atomically."""
    from edgellm.loaders import save_checkpoint

    tmp = _staging(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tokenizer = out / TOKENIZER
    save_checkpoint(model, tmp, {"format": STATE_FORMAT, "format_version": STATE_VERSION, **state},
                    tokenizer=tokenizer if tokenizer.is_file() else None)
    if (out / DATA_DIR).is_dir():
        (tmp / DATA_DIR).mkdir()
        for f in (out / DATA_DIR).iterdir():
            if f.is_file():
                _link_or_copy(f, tmp / DATA_DIR / f.name)
    if out.exists():
        out.rename(_old(out))
    tmp.rename(out)
    shutil.rmtree(_old(out), ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the token cache can be large: share the inode, never copy it per save
    except OSError:
        shutil.copy2(src, dst)


def load(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(train state, model state_dict) of the checkpoint in `out`; rejects other formats and versions."""
    from edgellm.loaders import load_checkpoint, load_extra_state

    need(is_complete(out), f"--resume: {out} holds no training checkpoint (edgellm.json + extra_state.json)")
    state = load_extra_state(out) or {}
    need(state.get("format") == STATE_FORMAT, f"{out}/extra_state.json: not an {STATE_FORMAT} tree")
    need(state.get("format_version") == STATE_VERSION, f"{out}/extra_state.json: train state format_version "
         f"{state.get('format_version')!r} is not supported (expected {STATE_VERSION})")
    return state, load_checkpoint(out).model.state_dict()
