"""A JSON Schema's regular expressions (``pattern``, ``patternProperties`` names) in Rust syntax.

JSON Schema patterns are ECMA-262; see :mod:`ninfer.guided.ecma_regex` for why they are
rewritten. The walk follows schema keywords only, so data that merely looks like a
schema (``const``, ``enum``, ``default``, ``examples``) is left as it is. The caller's
schema is never modified: walked objects are rebuilt, the rest is shared.
"""

from __future__ import annotations

from typing import Any

from ninfer.guided.ecma_regex import PatternError, ecma_to_rust

#: keywords whose value maps names to subschemas
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
#: keywords whose value is a list of subschemas
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: keywords whose value is one subschema
SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
           "contains", "propertyNames", "not", "if", "then", "else", "contentSchema")


def schema_with_rust_patterns(schema: Any, where: str = "") -> Any:
    """``schema`` with every pattern rewritten; a PatternError names the JSON pointer at fault."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or a dependency's list of names
    out: dict[str, Any] = {}
    for key, value in schema.items():
        at = f"{where}/{_pointer_token(key)}"
        if key == "pattern" and isinstance(value, str):
            out[key] = _rewrite(value, at)
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = _subschema_map(value, at, names_are_patterns=key == "patternProperties")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [schema_with_rust_patterns(s, f"{at}/{n}") for n, s in enumerate(value)]
        elif key in SCHEMAS:
            out[key] = schema_with_rust_patterns(value, at)
        else:
            out[key] = value
    return out


def _subschema_map(value: dict, at: str, names_are_patterns: bool) -> dict:
    out: dict[str, Any] = {}
    for name, sub in value.items():
        where = f"{at}/{_pointer_token(name)}"
        sub = schema_with_rust_patterns(sub, where)
        if names_are_patterns:
            name = _rewrite(name, where)
            if name in out:  # "\\d" and "[0-9]" are one pattern now: a match must satisfy both
                sub = {"allOf": [out[name], sub]}
        out[name] = sub
    return out


def _rewrite(pattern: str, at: str) -> str:
    try:
        return ecma_to_rust(pattern)
    except PatternError as e:
        raise PatternError(f"{at}: {e}") from None


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
