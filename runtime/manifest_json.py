"""manifest.json as JSON: the schema of each object (keys exact, per format version) and the parse into a
`Manifest`, which then validates itself (manifest.py)."""

from __future__ import annotations

from .errors import EdgeError, need
from .fileio import FileSpec
from .graphio import TensorSpec
from .jsoncheck import check_type, is_int, json_type
from .jsoncheck import fields as checked
from .manifest import COLUMNS_SINCE, COVER_SINCE, FORMAT, KV_DTYPE_SINCE, READS, GraphSpec, Manifest


def no_constant(name: str) -> None:
    raise EdgeError(f"{name} is not allowed in manifest.json")


# JSON schemas, key -> JSON type ("?": may be null). Keys are exact: a missing or unknown key is an error.
# The keys are the dataclass field names, so a checked object is passed on with **.
_TENSOR = {"name": "string", "shape": "array", "dtype": "string"}
_GRAPH = {"name": "string", "role": "string", "layer": "integer?", "seq": "integer", "file": "string",
          "data": "string?", "inputs": "array", "outputs": "array", "paired": "boolean"}
_FILE = {"sha256": "string", "bytes": "integer"}
_TOP = {"format": "string", "format_version": "integer", "edgellm_version": "string", "preset": "string?",
        "config": "object", "granularity": "string", "kv_layout": "string", "max_seq": "integer", "prefill_chunk": "integer",
        "opset": "integer", "graphs": "array", "files": "object", "tokenizer": "object?", "bos_id": "integer?",
        "eos_id": "integer?", "eos_ids": "array", "sampler": "object", "quantization": "object?", "export_options": "object",
        "verification": "object", "kv_head_dim": "integer?", "kv_cache_rows": "array?"}
_TOP_12 = {**_TOP, "logit_columns": "string?"}
_TOP_14 = {**_TOP_12, "kv_dtype": "string"}
_TOP_16 = {**_TOP_14, "sliding_cache": "string"}
def _tensor(value: object, where: str) -> TensorSpec:
    t = checked(value, _TENSOR, where)
    for i, n in enumerate(t["shape"]):
        need(is_int(n) and n >= 1, f"{where}.shape[{i}]: expected a positive integer, got {n!r}")
    return TensorSpec(t["name"], tuple(t["shape"]), t["dtype"])


def _graph(value: object, where: str) -> GraphSpec:
    g = checked(value, _GRAPH, where)
    io = {side: tuple(_tensor(t, f"{where}.{side}[{i}]") for i, t in enumerate(g[side]))
          for side in ("inputs", "outputs")}
    return GraphSpec(**{**g, **io})


def parse(doc: object) -> Manifest:
    need(isinstance(doc, dict), f"expected a JSON object, got {json_type(doc)}")
    # format and version first: another version may have other keys, and must get this message
    need(doc.get("format") == FORMAT, f"format: expected {FORMAT!r}, got {doc.get('format')!r}")
    version = doc.get("format_version")
    need(is_int(version), f"format_version: expected an integer, got {version!r}")
    need(version <= max(READS), f"format_version {version} is not supported (this edgellm reads "
                                f"{READS[0]}-{READS[-1]}; update edgellm)")
    need(version in READS, f"format {version} was written by an older edgellm; re-export with this version "
                           f"(reads {READS[0]}-{READS[-1]})")
    if version == 8 and isinstance(doc.get("graphs"), list):
        need(all(not isinstance(g, dict) or g.get("role") != "head" or not g.get("paired") for g in doc["graphs"]),
             "graphs: a paired head needs format_version 9, this manifest says 8")
    d = checked(doc, _TOP_16 if version >= COVER_SINCE else _TOP_14 if version >= KV_DTYPE_SINCE
                else _TOP_12 if version >= COLUMNS_SINCE else _TOP, "")
    for name, diff in d["verification"].items():
        check_type(diff, "number", f"verification[{name!r}]")
    fields = {k: v for k, v in d.items() if k != "format"}
    fields["eos_ids"] = tuple(d["eos_ids"])
    if d["kv_cache_rows"] is not None:
        need(all(is_int(r) for r in d["kv_cache_rows"]), "kv_cache_rows: expected a list of integers or null")
        fields["kv_cache_rows"] = tuple(d["kv_cache_rows"])
    fields["graphs"] = tuple(_graph(g, f"graphs[{i}]") for i, g in enumerate(d["graphs"]))
    fields["files"] = {rel: FileSpec(**checked(f, _FILE, f"files[{rel!r}]")) for rel, f in d["files"].items()}
    return Manifest(**fields)
