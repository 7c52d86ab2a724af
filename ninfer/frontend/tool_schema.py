"""Declared tools and how a parameter's schema types the text a model wrote for it.

Some call formats carry every argument as untyped text (Qwen's XML calls do). The tool's
JSON schema only guides conversion of that text; it never decides whether markup is a call, and
nothing here validates a value against the schema beyond its top-level type.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

#: the type names a schema may state directly (JSON Schema's seven primitive types)
PRIMITIVE_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})


@dataclass(frozen=True)
class ToolSpec:
    """One callable tool as the engine sees it.

    ``name`` is the identity the model writes; protocol adapters that namespace tools
    fold the namespace into it. ``parameters`` is the JSON schema object of the
    arguments, with member order as received.
    """

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    #: the client asked for arguments that follow ``parameters`` exactly (enforced by a
    #: tool-call grammar whenever one is in force)
    strict: bool = False
    #: the request field holding ``parameters``, named by errors about the schema
    param: str = "tools"

    def parameter_types(self, key: str) -> frozenset[str] | None:
        """The explicit types of top-level parameter ``key``; None means untyped."""
        props = self.parameters.get("properties")
        prop = props.get(key) if isinstance(props, dict) else None
        return schema_types(prop) if isinstance(prop, dict) else None


def _direct_types(schema: dict[str, Any]) -> frozenset[str] | None:
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared
    if not isinstance(names, list) or not names:
        return None
    if not all(isinstance(n, str) and n in PRIMITIVE_TYPES for n in names):
        return None
    return frozenset(names)


def schema_types(schema: dict[str, Any]) -> frozenset[str] | None:
    """Types a property schema admits when stated explicitly, else None.

    Supported: a ``type`` (one name or a list of names), or an ``anyOf``/``oneOf``
    whose every branch states such a type. Anything else keeps untyped inference.
    """
    direct = _direct_types(schema)
    if direct is not None:
        return direct
    for combinator in ("anyOf", "oneOf"):
        branches = schema.get(combinator)
        if isinstance(branches, list) and branches:
            found = [_direct_types(b) if isinstance(b, dict) else None for b in branches]
            if all(t is not None for t in found):
                return frozenset().union(*found)  # type: ignore[arg-type]
            return None
    return None


class DuplicateKeyError(ValueError):
    """A JSON object repeats a member name."""


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise DuplicateKeyError("duplicate member name")
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 would re-serialise as the non-JSON "Infinity"
        raise ValueError("number out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class JSONTooDeepError(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`."""


class LoneSurrogateError(ValueError):
    """JSON whose ``\\u`` escapes decode to half of a UTF-16 pair: not text we can encode."""


#: deepest nesting of arrays and objects accepted in JSON text inside a string (tool
#: arguments); fixed well below Python's recursion limit so the answer never depends on
#: how deep the parser's own call stack happens to be
MAX_JSON_DEPTH = 128
_BRACKET_OR_STRING = re.compile(r'[\[{\]}]|"(?:[^"\\]|\\.)*"?')  # brackets inside strings don't count
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (closers may be missing or stray)."""
    depth = deepest = 0
    for match in _BRACKET_OR_STRING.finditer(text):
        c = match.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
    return deepest


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string (or member name) in a decoded JSON value holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= c <= "\udfff" for c in item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def loads_json(text: str) -> Any:
    """Parse strict JSON: no NaN/Infinity, no overflowing numbers, no repeated members, at
    most :data:`MAX_JSON_DEPTH` levels deep, no lone surrogates.

    Raises ValueError (DuplicateKeyError, JSONTooDeepError, LoneSurrogateError for those
    cases); key order is kept.
    """
    # counting brackets is cheap; the exact depth is needed only when there are many
    if text.count("{") + text.count("[") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise JSONTooDeepError(f"JSON nests more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(
            text, object_pairs_hook=_unique_members, parse_float=_finite_float, parse_constant=_reject_constant
        )
    except RecursionError:  # a backstop: the depth check above should make this unreachable
        raise JSONTooDeepError("JSON nests too deeply") from None
    if _SURROGATE_ESCAPE.search(text) and has_lone_surrogate(value):
        raise LoneSurrogateError("JSON string escapes decode to a lone UTF-16 surrogate")
    return value


def dumps_json(value: Any) -> str:
    """The one serialisation used for tool arguments, in streams and aggregates alike."""
    return json.dumps(value, ensure_ascii=False)


class Conversion(enum.Enum):
    OK = "ok"
    OMITTED = "omitted"  # empty text for a parameter that cannot be a string
    MISMATCH = "mismatch"  # kept, but not of a declared type


def _json_type_admitted(value: Any, types: frozenset[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if value is None:
        return "null" in types
    kind = {str: "string", dict: "object", list: "array"}[type(value)]
    return kind in types


def convert_parameter(text: str, types: frozenset[str] | None) -> tuple[Any, Conversion]:
    """Turn a parameter's raw text into a JSON value under its declared types."""
    if types is None:  # untyped: JSON when it parses, the text otherwise
        try:
            return loads_json(text), Conversion.OK
        except ValueError:
            return text, Conversion.OK
    if "string" in types:
        return text, Conversion.OK
    stripped = text.strip()
    if not stripped:
        return None, Conversion.OMITTED
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true", Conversion.OK
    try:
        value = loads_json(stripped)
    except ValueError:
        return text, Conversion.MISMATCH
    return value, Conversion.OK if _json_type_admitted(value, types) else Conversion.MISMATCH
