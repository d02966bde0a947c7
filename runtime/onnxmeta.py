"""The external-data table and op types of an .onnx file, read without the `onnx` package (the board does
not have it).

The runtime hands onnxruntime every external weight itself, as a view into one read-only memory map per
data file, so the prefill and decode sessions of a graph (and a tied embedding's embed and head graphs)
share one copy of the weights: see `weightmap.SharedWeights`. For that it needs, per initializer stored
outside the .onnx file, its name, shape, dtype and (file, offset, length) — a few fields of the protobuf.

Protobuf wire format: each field is a varint key (field_number << 3 | wire_type) then its value:
wire type 0 = varint, 1 = 8 bytes, 2 = varint length + bytes, 5 = 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EdgeError, need

# ModelProto.graph = 7; GraphProto.node = 1, .initializer = 5; NodeProto.input = 1, .op_type = 4,
# .attribute = 5; AttributeProto.g = 6, .graphs = 11 (an If's branches, a Loop's body); TensorProto fields:
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE = 7, 1, 5, 1, 2, 4
_NODE_ATTRIBUTE, _ATTR_GRAPH, _ATTR_GRAPHS = 5, 6, 11
_T_DIMS, _T_DATA_TYPE, _T_NAME, _T_EXTERNAL_DATA, _T_DATA_LOCATION = 1, 2, 8, 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

# TensorProto.DataType -> numpy; other types (bfloat16, float8, 4-bit) are left to onnxruntime to load.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16),
    5: np.dtype(np.int16), 6: np.dtype(np.int32), 7: np.dtype(np.int64), 9: np.dtype(np.bool_),
    10: np.dtype(np.float16), 11: np.dtype(np.float64), 12: np.dtype(np.uint32), 13: np.dtype(np.uint64),
}


@dataclass(frozen=True)
class ExternalTensor:
    name: str
    shape: tuple[int, ...]
    data_type: int      # TensorProto.DataType
    location: str       # the data file, relative to the .onnx file's directory
    offset: int
    length: int         # bytes


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        need(pos < len(buf), "truncated protobuf varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        need(shift < 70, "corrupt protobuf varint")


def _fields(buf: memoryview, start: int, end: int):
    """Yield (field number, wire type, value): an int for varints/fixed, a (start, end) span for bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            need(pos + size <= end, "truncated protobuf field")
            yield field, wire, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            need(pos + size <= end, "truncated protobuf field")
            yield field, wire, int.from_bytes(buf[pos:pos + size], "little")
            pos += size
        else:
            raise EdgeError(f"unsupported protobuf wire type {wire}")


def _tensor(buf: memoryview, start: int, end: int) -> ExternalTensor | None:
    dims: list[int] = []
    data_type, location, name = 0, 0, ""
    entries: dict[str, str] = {}
    for field, wire, value in _fields(buf, start, end):
        if field == _T_DIMS and wire == 0:
            dims.append(value)
        elif field == _T_DIMS and wire == 2:  # packed repeated int64
            pos, stop = value
            while pos < stop:
                dim, pos = _varint(buf, pos)
                dims.append(dim)
        elif field == _T_DATA_TYPE:
            data_type = value
        elif field == _T_NAME:
            name = bytes(buf[value[0]:value[1]]).decode("utf-8")
        elif field == _T_DATA_LOCATION:
            location = value
        elif field == _T_EXTERNAL_DATA:
            kv = {f: bytes(buf[s:e]).decode("utf-8") for f, _, (s, e) in _fields(buf, *value)}
            entries[kv.get(1, "")] = kv.get(2, "")
    if location != _EXTERNAL:
        return None
    need("location" in entries, f"initializer {name!r}: external data without a location")
    offset = int(entries.get("offset", "0"))
    length = int(entries["length"]) if "length" in entries else -1
    return ExternalTensor(name, tuple(dims), data_type, entries["location"], offset, length)


def _inputs(buf: memoryview, start: int, end: int, field: int = _NODE_INPUT) -> list[str]:
    """The input names of one NodeProto (its output names with field=_NODE_OUTPUT)."""
    return [bytes(buf[v[0]:v[1]]).decode("utf-8") for f, w, v in _fields(buf, start, end)
            if f == field and w == 2]


def _op_types(buf: memoryview, start: int, end: int, depth: int = 0) -> list[str]:
    """The op_type of one NodeProto and of every node in its subgraphs (an If's branches)."""
    need(depth < 8, "subgraphs nested too deep")
    out = []
    for field, wire, value in _fields(buf, start, end):
        if field == _NODE_OP_TYPE and wire == 2:
            out.append(bytes(buf[value[0]:value[1]]).decode("utf-8"))
        elif field == _NODE_ATTRIBUTE and wire == 2:
            for afield, awire, avalue in _fields(buf, *value):
                if afield in (_ATTR_GRAPH, _ATTR_GRAPHS) and awire == 2:
                    for gfield, gwire, gvalue in _fields(buf, *avalue):
                        if gfield == _GRAPH_NODE and gwire == 2:
                            out += _op_types(buf, *gvalue, depth + 1)
    return out


@dataclass(frozen=True)
class GraphInfo:
    external: list[ExternalTensor]  # initializers of the main graph stored in external files
    op_types: frozenset[str]        # op types of the main graph's nodes and of their subgraphs
    # initializers the main graph reads only as a Gather's table (input 0): an embedding lookup touches a few
    # rows per step, so its pages are worth releasing between runs (placement.plan)
    gathered: frozenset[str] = frozenset()
    # initializers the main graph reads only as MatMulNBits' scales (input 2), or as the weights of a MatMul whose
    # other input an AveragePool makes (the block-offset term of 4-bit weights with block minima: quant/rewrite.py):
    # onnxruntime packs them when it pre-packs, yet keeps its own copy for the session's life (placement.plan maps
    # them instead)
    packed_consts: frozenset[str] = frozenset()


def read_graph_info(path: Path) -> GraphInfo:
    try:
        buf = memoryview(Path(path).read_bytes())
    except OSError as err:
        raise EdgeError(f"{path}: cannot read ({err.strerror})") from None
    try:
        external: list[ExternalTensor] = []
        ops: set[str] = set()
        tables: set[str] = set()  # Gather's input 0
        packed: set[str] = set()  # MatMulNBits' input 2, and a block-mean MatMul's input 1
        other: set[str] = set()   # every other input of a main-graph node
        pooled: set[str] = set()  # AveragePool outputs
        matmuls: list[list[str]] = []
        for field, wire, value in _fields(buf, 0, len(buf)):
            if field != _MODEL_GRAPH or wire != 2:
                continue
            for gfield, gwire, gvalue in _fields(buf, *value):
                if gfield == _GRAPH_INITIALIZER and gwire == 2:
                    tensor = _tensor(buf, *gvalue)
                    if tensor is not None:
                        external.append(tensor)
                elif gfield == _GRAPH_NODE and gwire == 2:
                    types = _op_types(buf, *gvalue)
                    ops.update(types)
                    inputs = _inputs(buf, *gvalue)
                    if types[:1] == ["Gather"] and inputs:
                        tables.add(inputs[0])
                        inputs = inputs[1:]
                    elif types[:1] == ["MatMulNBits"] and len(inputs) > 2:
                        packed.add(inputs[2])
                        inputs = inputs[:2] + inputs[3:]
                    elif types[:1] == ["MatMul"] and len(inputs) == 2:
                        matmuls.append(inputs)
                        continue
                    elif types[:1] == ["AveragePool"]:
                        pooled.update(_inputs(buf, *gvalue, field=_NODE_OUTPUT))
                    other.update(inputs)
        for a, b in matmuls:  # which MatMul reads an AveragePool is known once every node was seen
            other.add(a)
            (packed if a in pooled else other).add(b)
        return GraphInfo(external, frozenset(ops), frozenset(tables - other - packed),
                         frozenset(packed - other - tables))
    except (EdgeError, ValueError, UnicodeDecodeError) as err:
        raise EdgeError(f"{path}: not a readable ONNX model ({err})") from None


def external_tensors(path: Path) -> list[ExternalTensor]:
    """Every initializer of the model's main graph whose data lives in an external file."""
    return read_graph_info(path).external
