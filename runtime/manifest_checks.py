"""The manifest's cross-field checks of its graph list and its tokenizer entry (manifest.py calls them from
`Manifest.validate`; JSON types are checked before, when parsing). Each failure is an EdgeError naming the key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .errors import need
from .fileio import FileSpec
from .graphio import STACK_ROLES, Dims, check_io
from .tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    from .manifest import GraphSpec

ROLES_BY_GRANULARITY = {"layer": ("embed", "layer", "head", *STACK_ROLES), "model": ("model",)}
OPTIONAL_ROLES = STACK_ROLES  # an export may have none of these graphs (else both variants)
TOKENIZER_KEYS = ("file", "kind", "chat_template", "add_bos")


def check_graphs(graphs: Sequence[GraphSpec], granularity: str, kv_layout: str, prefill_chunk: int,
                 files: Mapping[str, FileSpec], dims: Dims) -> None:
    """Every graph named once, of a role its granularity has, at S = 1 or prefill_chunk, its files listed, its
    I/O as `graph_io` says; paired variants in one file; no (role, layer, seq) missing."""
    roles = ROLES_BY_GRANULARITY[granularity]
    seqs = {1, prefill_chunk}
    seen: dict[tuple, str] = {}
    names: set[str] = set()
    layers = {(g.layer, g.seq): g for g in graphs if g.role == "layer"}
    for n, g in enumerate(graphs):
        where = f"graphs[{n}] ({g.name})"
        need(g.name not in names, f"{where}: duplicate graph name")
        names.add(g.name)
        need(g.role in roles, f"{where}.role: expected one of {list(roles)} for granularity "
                              f"{granularity!r}, got {g.role!r}")
        need((g.role == "layer") == (g.layer is not None), f"{where}.layer: expected an index for role "
                                                           f"'layer' and null otherwise, got {g.layer!r}")
        need(g.layer is None or 0 <= g.layer < dims.n_layers, f"{where}.layer: expected 0..{dims.n_layers - 1}")
        need(g.seq in seqs, f"{where}.seq: expected 1 or prefill_chunk={prefill_chunk}, got {g.seq}")
        key = (g.role, g.layer, g.seq)
        need(key not in seen, f"{where}: same role/layer/seq as {seen.get(key)}")
        seen[key] = g.name
        for rel in (g.file, g.data):
            need(rel is None or rel in files, f"{where}: file {rel!r} is not listed in files")
        check_io(g.role, g.seq, g.layer, (g.inputs, g.outputs), dims, where)
        if g.paired:  # the other variant of this layer names the same files
            need(g.role in ("layer", "head", *STACK_ROLES) and kv_layout == "inplace" and prefill_chunk > 1,
                 f"{where}.paired: only layer, stack or head graphs of an 'inplace' export with prefill_chunk > 1")
            other = layers.get((g.layer, prefill_chunk if g.seq == 1 else 1))
            need(g.role != "layer" or other is None or
                 (other.paired and (other.file, other.data) == (g.file, g.data)),
                 f"{where}.paired: the other variant of layer {g.layer} must be paired in the same file")
    for role in STACK_ROLES:
        stacks = [g for g in graphs if g.role == role]
        need(len({g.file for g in stacks}) <= 1 and all(g.paired for g in stacks),
             f"graphs: the {role} graph's two variants must be paired in one file")
    heads = [g for g in graphs if g.role == "head"]
    need(not any(g.paired for g in heads) or (len({g.file for g in heads}) == 1 and all(g.paired for g in heads)),
         "graphs: a paired head's two variants must both be paired, in one file")
    # every key seen is valid and unique, so comparing counts finds a missing graph
    optional = [r for r in OPTIONAL_ROLES if not any(g.role == r for g in graphs)]
    want = [(r, i, s) for r in roles if r not in optional
            for i in (range(dims.n_layers) if r == "layer" else [None]) for s in seqs]
    missing = [k for k in want if k not in seen]
    need(not missing, f"graphs: missing (role, layer, seq) {missing[:4]}{' ...' if len(missing) > 4 else ''}")


def check_tokenizer(tokenizer: Mapping[str, object], files: Mapping[str, FileSpec], bos_id: int | None) -> None:
    """The `tokenizer` entry: exactly its keys, its files listed, a known kind, a chat template only for a
    Hugging Face tokenizer, add_bos a boolean that needs a bos_id."""
    need(set(tokenizer) == set(TOKENIZER_KEYS), f"tokenizer: expected keys {', '.join(map(repr, TOKENIZER_KEYS))}")
    file, template, kind = tokenizer["file"], tokenizer["chat_template"], tokenizer["kind"]
    need(isinstance(file, str) and file in files, f"tokenizer.file: {file!r} is not listed in files")
    need(isinstance(kind, str) and kind in TOKENIZER_FILES,
         f"tokenizer.kind: expected one of {', '.join(TOKENIZER_FILES)}, got {kind!r:.40}")
    need(template is None or (isinstance(template, str) and template in files),
         f"tokenizer.chat_template: {template!r} is not listed in files")
    need(template is None or kind == "hf", "tokenizer.chat_template: needs a Hugging Face tokenizer (kind 'hf')")
    add_bos = tokenizer["add_bos"]
    need(isinstance(add_bos, bool), f"tokenizer.add_bos: expected true or false, got {add_bos!r}")
    need(not add_bos or bos_id is not None, "tokenizer.add_bos: true needs a bos_id")
