"""A small valid instance of a JSON schema: what the mock answers a `response_format` json_schema
or a tool's `parameters` with, so a client that validates the reply (or parses it into its
pydantic model) gets something that passes.

Minimal means: required properties only, arrays at `minItems`, numbers at their lower bound,
strings of the word "the" at `minLength`; `enum` and `const` give their first value, `anyOf` /
`oneOf` their first branch, `allOf` its merged branches, and local `$ref`s (`#/$defs/...`, as
pydantic writes nested models) are followed. `pattern` and `format` other than a few common
ones (date-time, date, time, email, uri, uuid) are not honoured: the string is the plain word.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from testbed.core.json_types import JSONObject

MAX_DEPTH = 32  # $ref cycles and deep schemas end here
MAX_VALUES = 10_000  # values in one instance (minItems nest multiplicatively)
MAX_STRING = 65_536  # characters of one string


class SchemaError(ValueError):
    """The schema cannot be instantiated (an unknown type, a broken $ref, a cycle)."""


_FORMATS = {
    "date-time": "2025-01-01T00:00:00Z",
    "date": "2025-01-01",
    "time": "00:00:00Z",
    "email": "the@example.com",
    "uri": "https://example.com/the",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


def instance(schema: Any) -> Any:
    """A minimal value valid against `schema` (a JSON schema object or a boolean schema)."""
    try:
        return _Builder(schema).build(schema, 0)
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        if isinstance(e, SchemaError):
            raise
        raise SchemaError(f"malformed schema: {type(e).__name__}: {e}") from None


def _resolve(ref: str, root: Any) -> Any:
    if not ref.startswith("#"):
        raise SchemaError(f"only local $refs are followed, not {ref!r}")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaError(f"$ref {ref!r} points at nothing")
        node = node[part]
    return node


class _Builder:
    """One instance's construction: the schema's root (for $refs) and the values made so far."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.values = 0

    def build(self, s: Any, depth: int) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise SchemaError(f"the minimal instance has more than {MAX_VALUES} values")
        return _instance(self, s, depth)


def _count(s: Mapping[str, object], key: str, top: int) -> int:
    v = s.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SchemaError(f"{key!r} must be a non-negative integer")
    if v > top:
        raise SchemaError(f"{key!r} is over {top}")
    return v


def _instance(b: _Builder, s: Any, depth: int) -> Any:
    root = b.root
    if depth > MAX_DEPTH:
        raise SchemaError(f"schema nests (or refers to itself) more than {MAX_DEPTH} deep")
    if s is True or s == {}:
        return None
    if not isinstance(s, dict):
        raise SchemaError("a schema must be an object or true")
    if "$ref" in s:
        return b.build({**_resolve(str(s["$ref"]), root), **{k: v for k, v in s.items() if k != "$ref"}}, depth + 1)
    if "const" in s:
        return s["const"]
    if isinstance(s.get("enum"), list) and s["enum"]:
        return s["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and s[key]:
            return b.build(s[key][0], depth + 1)
    if isinstance(s.get("allOf"), list):
        merged = {k: v for k, v in s.items() if k != "allOf"}
        for part in s["allOf"]:
            part = _resolve(part["$ref"], root) if isinstance(part, dict) and "$ref" in part else part
            if isinstance(part, dict):
                merged = _merge(merged, part)
        return b.build(merged, depth + 1)
    t = s.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null") if t else None
    if t is None:
        t = (
            "object"
            if "properties" in s or "required" in s
            else "array"
            if "items" in s
            else "string"
            if "minLength" in s or "maxLength" in s
            else None
        )
    if t is None:
        return None
    if t == "object":
        props = s.get("properties") or {}
        req = s.get("required") or []
        out: JSONObject = {}
        for name in req:
            out[name] = b.build(props.get(name, True), depth + 1)
        return out
    if t == "array":
        items = s.get("items", True)
        prefix = s.get("prefixItems") or []
        n = _count(s, "minItems", MAX_VALUES)
        enum = items.get("enum") if isinstance(items, dict) else None
        if s.get("uniqueItems") and isinstance(enum, list) and len(enum) >= n and not prefix:
            return enum[:n]  # distinct items; other item schemas repeat one instance
        return [b.build(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(n)]
    if t == "string":
        return _string(s)
    if t in ("integer", "number"):
        return _number(s, t == "integer")
    if t == "boolean":
        return False
    if t == "null":
        return None
    raise SchemaError(f"unknown type {t!r}")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **{k: v for k, v in b.items() if k not in ("properties", "required")}}
    out["properties"] = {**(a.get("properties") or {}), **(b.get("properties") or {})}
    out["required"] = list(dict.fromkeys([*(a.get("required") or []), *(b.get("required") or [])]))
    return out


def _string(s: Mapping[str, object]) -> str:
    fmt = s.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    lo = _count(s, "minLength", MAX_STRING)
    hi = s.get("maxLength")
    text = "the" if lo <= 3 else ("the " * lo)[:lo]
    return text[:hi] if isinstance(hi, int) and hi >= 0 else text


def _num(s: Mapping[str, object], key: str) -> float | None:
    v = s.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _number(s: Mapping[str, object], integer: bool) -> int | float:
    """0 when the bounds allow it, else the lowest allowed value (a multiple of `multipleOf`)."""
    lo, hi = _num(s, "minimum"), _num(s, "maximum")
    xlo, xhi = _num(s, "exclusiveMinimum"), _num(s, "exclusiveMaximum")
    low = -math.inf if lo is None else lo
    high = math.inf if hi is None else hi
    if xlo is not None:
        low = max(low, math.floor(xlo) + 1 if integer else xlo + min(1.0, (high - xlo) / 2))
    if xhi is not None:
        high = min(high, math.ceil(xhi) - 1 if integer else xhi - min(1.0, (xhi - low) / 2))
    if integer:
        low = math.ceil(low) if math.isfinite(low) else low
        high = math.floor(high) if math.isfinite(high) else high
    v = 0.0 if low <= 0 <= high else (low if math.isfinite(low) else high)
    step = _num(s, "multipleOf")
    if step is not None and step > 0 and not math.isclose(v / step, round(v / step)):
        v = math.ceil(v / step) * step
    return int(v) if integer else v
