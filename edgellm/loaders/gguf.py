"""Load a GGUF file (llama.cpp) into a float32 `Decoder`, with its tokenizer rebuilt from the metadata.

As for Hugging Face directories (hf.py), everything is checked before the model is allocated: header,
architecture, config (gguf_config), the family's weight map planned against a meta-device model, every
tensor's presence, ggml type and shape (tensor table only), and the tokenizer built. Then the model is
allocated and filled one dequantized tensor at a time (tensors.fill_model over a GGUFSource).
"""

from __future__ import annotations

from pathlib import Path

from .gguf_config import gguf_to_config
from .gguf_file import GGUFFile, GGUFSource, has_magic
from .gguf_maps import unpermute
from .gguf_tokenizer import write_tokenizer
from .lazy import model_or_weights
from .loaded import Loaded
from .tensors import check_plan, meta_decoder, shapes


def is_gguf_file(path: Path) -> bool:
    """A .gguf file, or any file starting with the GGUF magic (load_gguf rejects a bad magic by name)."""
    return path.is_file() and (path.suffix.lower() == ".gguf" or has_magic(path))


def load_gguf(path: Path, lazy: bool = False) -> Loaded:
    """The model in a .gguf file; `lazy`: checked the same, but each tensor stays in the memory-mapped file
    until a unit asks for it (`Loaded.weights`, a LazyWeights owning the open file; model on the meta device)."""
    path = Path(path)
    g = GGUFFile(path)
    try:
        source = GGUFSource(g)
        cfg, family = gguf_to_config(g, source)
        if family.permuted_qk:
            source.transforms = {}
            for i in range(cfg.n_layers):
                source.transforms[f"blk.{i}.attn_q.weight"] = unpermute(cfg.n_heads)
                source.transforms[f"blk.{i}.attn_k.weight"] = unpermute(cfg.n_kv_heads)
        meta = meta_decoder(cfg)
        plan = family.weights.plan(meta.state_dict())
        ignored = {name for name in source.names() if family.weights.is_ignored(name)}
        check_plan(shapes(meta), plan, source, str(path), ignored)
        tokenizer = write_tokenizer(g)  # before allocating: a broken vocabulary fails fast too
        g.forget("tokenizer.ggml.")
        model, weights = model_or_weights(meta, plan, source, lazy)
    except BaseException:
        g.close()
        raise
    return Loaded(model, cfg, tokenizer, "gguf", weights)


def describe(extra: dict) -> list[str]:
    """Lines for `edgellm info` from a GGUF load's config.extra: version, architecture, tensor types."""
    types = extra.get("gguf_tensor_types") or {}
    listing = ", ".join(f"{kind} x{count}" for kind, count in types.items())
    return [f"gguf version: {extra.get('gguf_version')}", f"gguf architecture: {extra.get('architecture')}",
            f"gguf name: {extra.get('gguf_name') or 'none'}",
            f"gguf tensors: {sum(types.values())} ({listing})"]
