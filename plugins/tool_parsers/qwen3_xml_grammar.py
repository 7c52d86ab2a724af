"""The tool-call grammar of the ``qwen3_xml`` format.

A call body is ``<function=NAME>`` followed by one block per parameter::

    <parameter=KEY>
    VALUE
    </parameter>

and ``</function>``. Parameters come in declaration order: required ones always,
optional ones at most once. The value's form follows how the parser reads it back
(:func:`ninfer.frontend.tool_schema.convert_parameter`): a parameter that admits a string
is raw text, which may not contain ``</parameter>`` or ``<parameter=`` (the format has
no escape); any other is embedded JSON. Strict tools hold each value to its property
schema (for strings: ``enum``, ``const``, ``minLength`` and ``maxLength``; ``pattern`` and
``format`` cannot be expressed on raw text and are refused). A schema without declared
properties that allows others takes any well-formed parameters.

Each value is lexed together with its closing ``</parameter>``: a free-text lexeme
followed by a separate closing literal could not tell where the text ends.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_schema import ToolSpec, schema_types
from ninfer.guided.spec import GuideSpec
from ninfer.frontend.tool_grammar import (
    argument_schema,
    build_grammar,
    check_name,
    check_schema,
    embedded_json,
    lark_string,
)
from ninfer_plugins.tool_parsers.markers import TOOL_CALL_GRAMMAR

VALUE_END = lark_string("\n</parameter>\n")
#: shared terminals: text without the format's markers, and such a value with its close
SHARED = "\n".join((
    "PLAIN: /(?s:.*)/ & ~/(?s:.*)(<\\/parameter>|<parameter=)(?s:.*)/",
    f"TEXT_VALUE: PLAIN {VALUE_END}",
    'ANY_PARAM: "<parameter=" /[^ \\t\\r\\n<>]{1,256}/ ">\\n" TEXT_VALUE',
))
MARKERS = ("</parameter>", "<parameter=")
#: parameters-level keywords whose meaning a sequence of optional blocks cannot carry
_UNEXPRESSIBLE = ("anyOf", "oneOf", "allOf", "not", "$ref", "if", "patternProperties", "propertyNames",
                  "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                  "unevaluatedProperties")
_STRING_CHECKS = ("enum", "const", "minLength", "maxLength", "pattern", "format")


def _refuse(tool: ToolSpec, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{tool.param}: the qwen3_xml tool-call format cannot enforce {what}",
                                   param=tool.param)


def _string_value(tool: ToolSpec, key: str, prop: dict[str, Any], terminal: str) -> str:
    """A terminal for a strict string value: its text and the closing tag."""
    if any(k in prop for k in ("pattern", "format")):
        raise _refuse(tool, f"a pattern or format on the string parameter {key!r}")
    if "const" in prop or "enum" in prop:
        options = [prop["const"]] if "const" in prop else prop["enum"]
        texts = [o for o in options if isinstance(o, str)] if isinstance(options, list) else []
        if not texts:
            raise InvalidRequestError(f"{tool.param}: parameter {key!r} allows no string value", param=tool.param)
        if any(m in t for t in texts for m in MARKERS):
            raise _refuse(tool, f"a value of {key!r} containing a parameter tag")
        alternatives = " | ".join(lark_string(t) for t in texts)
        return f"{terminal}: ({alternatives}) {VALUE_END}"
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (low, high or 0)):
        raise InvalidRequestError(f"{tool.param}: minLength and maxLength of {key!r} must be non-negative integers",
                                  param=tool.param)
    if low == 0 and high is None:
        return f"{terminal}: TEXT_VALUE"
    bounds = f"{low},{high}" if high is not None else f"{low},"
    return f"{terminal}: (/(?s:.){{{bounds}}}/ & PLAIN) {VALUE_END}"


def _value(tool: ToolSpec, key: str, prop: Any, defs: dict[str, Any], rule: str) -> tuple[str, list[str]]:
    """The grammar symbol for ``key``'s value (with its close) and the rules defining it."""
    prop = prop if isinstance(prop, dict) else {}
    types = schema_types(prop)
    if types is not None and "string" in types:  # read back as text, whatever else it admits
        if not tool.strict:
            return "TEXT_VALUE", []
        if any(k in prop for k in _STRING_CHECKS):
            terminal = rule.upper()
            return terminal, [_string_value(tool, key, prop, terminal)]
        branches = [b for c in ("anyOf", "oneOf") for b in prop.get(c) or () if isinstance(b, dict)]
        if any(k in b for b in branches for k in _STRING_CHECKS):
            raise _refuse(tool, f"constraints inside anyOf/oneOf on the string parameter {key!r}")
        return "TEXT_VALUE", []
    if types is None and not tool.strict:
        return "TEXT_VALUE", []  # untyped: the parser keeps text that is not JSON
    schema = {**defs, **prop}
    if tool.strict:
        check_schema(schema, tool.param)
    return rule, [f"{rule}: {embedded_json(schema)} {VALUE_END}"]


def _body(tool: ToolSpec, rule: str) -> str:
    check_name(tool.name, tool.param)
    schema = argument_schema(tool)
    bad = [k for k in _UNEXPRESSIBLE if k in schema]
    if bad:
        raise _refuse(tool, f"{', '.join(bad)} on the parameters object")
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    required = [k for k in schema.get("required") or () if isinstance(k, str)]
    for key in required:
        if key not in props:
            if extra is False:
                raise InvalidRequestError(f"{tool.param}: required parameter {key!r} is not allowed by the schema",
                                          param=tool.param)
            props = {**props, key: extra if isinstance(extra, dict) else {}}
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts, rules = [], []
    for i, (key, prop) in enumerate(props.items()):
        check_name(key, tool.param, "parameter name")
        value, defined = _value(tool, key, prop, defs, f"{rule}_v{i}")
        opener = lark_string(f"<parameter={key}>\n")
        rules += [f"{rule}_p{i}: {opener} {value}", *defined]
        parts.append(f"{rule}_p{i}" + ("" if key in required else "?"))
    if not props and extra is not False:
        if tool.strict and isinstance(extra, dict):
            raise _refuse(tool, "a schema for undeclared parameters")
        parts.append("ANY_PARAM*")
    head = lark_string(f"<function={tool.name}>\n")
    return "\n".join([f'{rule}: {head} {" ".join(parts)} "</function>"', *rules])


def qwen3_xml_grammar(tools: Sequence[ToolSpec], mode: str, *, parallel: bool = True,
                      answer: Optional[GuideSpec] = None) -> GuideSpec:
    """:attr:`ninfer.capabilities.ToolParser.grammar` for qwen3_xml."""
    spec = build_grammar(tools, mode, _body, parallel=parallel, markers=TOOL_CALL_GRAMMAR, answer=answer)
    return GuideSpec(spec.kind, spec.value + SHARED + "\n", spec.param)
