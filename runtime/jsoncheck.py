"""Checks of parsed JSON against a flat schema (key -> JSON type), for the files the runtime reads.

A schema maps each key to "string" | "integer" | "number" | "object" | "array", with "?" when null is allowed.
Keys are exact: a missing or unknown key is an error naming it. Booleans are never integers, numbers are finite.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import need


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "object": dict, "array": list, "boolean": bool}


def json_type(x: object) -> str:
    if x is None or isinstance(x, bool):
        return "null" if x is None else "boolean"
    return next((k for k, t in _JSON_TYPES.items() if isinstance(x, t)), type(x).__name__)  # bool handled above


def check_type(value: object, kind: str, where: str) -> None:
    if value is None and kind.endswith("?"):
        return
    want = kind.rstrip("?")
    ok = isinstance(value, bool) if want == "boolean" else isinstance(value, _JSON_TYPES[want]) and not isinstance(value, bool)
    ok = ok and (kind != "number" or math.isfinite(value))
    need(ok, f"{where}: expected {kind.rstrip('?')}{' or null' if kind.endswith('?') else ''}, "
             f"got {json_type(value)}")


def fields(value: object, schema: dict[str, str], where: str, root: str = "manifest") -> dict[str, Any]:
    """`value` checked against `schema`; `where` is its path in the document ("" at the top, named `root`)."""
    need(isinstance(value, dict), f"{where or root}: expected an object, got {json_type(value)}")
    missing = [k for k in schema if k not in value]
    need(not missing, f"{where or root}: missing key(s) {missing}")
    unknown = sorted(set(value) - set(schema))
    need(not unknown, f"{where or root}: unknown key(s) {unknown}")
    for key, kind in schema.items():
        check_type(value[key], kind, f"{where}.{key}" if where else key)
    return value
