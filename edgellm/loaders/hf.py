"""Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded) into a `Decoder`.

Everything is checked before the model is allocated: the config is translated (hf_config), the family's
weight map (hf_maps) is planned against the state-dict shapes of a model built on the meta device, and every
planned tensor's presence, dtype and shape is read from the safetensors headers. Then the real model is built
(uninitialised) and filled one tensor at a time (tensors.fill_model), so peak memory is ~1x the float32
model plus the largest source tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm.runtime.errors import EdgeError

from .hf_config import hf_to_config
from .hf_maps import NORM_OFFSET, family_map
from .lazy import model_or_weights
from .loaded import Loaded
from .tensors import TensorSource, check_plan, meta_decoder, shapes

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EdgeError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise EdgeError(f"{path}: expected a JSON object")
    return data


def open_weights(directory: Path) -> TensorSource:
    """model.safetensors, else the shards of model.safetensors.index.json (the order transformers uses)."""
    if (directory / SINGLE).is_file():
        return TensorSource([directory / SINGLE])
    if (directory / INDEX).is_file():
        return TensorSource.from_index(directory / INDEX)
    pickled = any((directory / name).exists() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"))
    raise EdgeError(f"{directory}: no {SINGLE} or {INDEX}" + (
        " (pytorch_model.bin is a pickle and is never loaded; re-save with safetensors)" if pickled else ""))


def load_hf(directory: Path, lazy: bool = False) -> Loaded:
    """The checkpoint in `directory`; `lazy`: checked the same, but the weights stay in the file
    (`Loaded.weights`, a LazyWeights owning the open source) and `Loaded.model` is on the meta device."""
    directory = Path(directory)
    config_path = directory / "config.json"
    hf = read_json(config_path)
    generation = read_json(directory / "generation_config.json") if (directory / "generation_config.json").is_file() else {}
    source = open_weights(directory)
    try:
        cfg = hf_to_config(hf, generation, "lm_head.weight" in source, config_path)
        weight_map = family_map(hf["model_type"], source.names())
        source.transposed = weight_map.is_transposed
        offset = NORM_OFFSET.get(hf["model_type"], 0.0)  # (offset + w) gains, folded as each norm is read
        source.offset = lambda name: offset if name.endswith("norm.weight") else 0.0
        meta = meta_decoder(cfg)
        plan = weight_map.plan(meta.state_dict())
        ignored = {name for name in source.names() if weight_map.is_ignored(name)}
        if cfg.tie_embeddings:
            ignored.add("lm_head.weight")  # transformers ties it to the embedding whatever the file holds
        check_plan(shapes(meta), plan, source, str(directory), ignored)
        tokenizer = directory / "tokenizer.json"
        tokenizer = tokenizer if tokenizer.is_file() else None
        model, weights = model_or_weights(meta, plan, source, lazy)
    except BaseException:
        source.close()
        raise
    return Loaded(model, cfg, tokenizer, "hf", weights)
