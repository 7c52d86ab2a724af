"""What the tool-call grammars of every format share: layout, JSON embedding, schema checks.

Tool-parser plugins build their ``grammar`` (see :class:`ninfer.capabilities.ToolParser`)
from these pieces.

A tool-call grammar is llguidance lark text (:class:`ninfer.guided.spec.GuideSpec` kind
``lark``). Each format supplies one rule per tool (the call body between the tags);
this module wraps the bodies in the format's markers (:class:`CallMarkers`, which the
plugin supplies) and arranges the calls for a mode:

* ``required``: the answer is one call (several when ``parallel``) and nothing else;
* ``auto``: free text, then optionally calls; with an ``answer`` guide the non-call
  output must follow that JSON schema instead of being free text.

Markers that the tokenizer holds as single added tokens are special tokens to
llguidance, so a plugin names them ``<tag>`` (a quoted string would make the model spell
the tag out byte by byte, which it never does). Free text cannot contain the opening
marker, token or spelled out, so once a call opens it must be valid. Calls are
separated by the markers' separator and nothing may follow the last one, as the strict
tool parsers expect. With thinking on, the engine starts the guide after the reasoning
and the blank line that follows it, where the answer starts.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_regions import valid_name
from ninfer.frontend.tool_schema import ToolSpec, schema_types
from ninfer.guided.schema_patterns import PatternError, schema_with_rust_patterns
from ninfer.guided.spec import GuideSpec

MODES = ("auto", "required")
#: JSON inside calls and answers: one layout, bounded (no runs of free whitespace a weak
#: model could loop on). Generic, not one format's: it is ``json.dumps``' and so Jinja's
#: ``tojson`` layout, which chat templates render call arguments with and models learn;
#: the guided backend lays out plain JSON guides the same way. A format that writes JSON
#: differently puts its own ``x-guidance`` in the schema it embeds, which wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: the param of a whole tool grammar (each piece is checked on its own first, with its own param)
GRAMMAR_PARAM = "tools"

#: ``body(tool, rule_name) -> lark rules`` defining ``rule_name`` as one call body of ``tool``
BodyRules = Callable[[ToolSpec, str], str]


def lark_string(text: str) -> str:
    """A lark string literal (JSON escapes are lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _compilable(schema: Mapping[str, Any], param: str) -> dict[str, Any]:
    """``schema`` as llguidance compiles it: ECMA-262 patterns in Rust syntax
    (:mod:`ninfer.guided.schema_patterns`), laid out in :data:`JSON_LAYOUT` (the schema's
    own x-guidance wins)."""
    try:
        schema = schema_with_rust_patterns(dict(schema))
    except PatternError as exc:
        raise InvalidRequestError(f"{param}: invalid JSON schema: {exc}", param=param) from exc
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def embedded_json(schema: Mapping[str, Any], param: str = GRAMMAR_PARAM) -> str:
    """``%json {...}`` for ``schema`` (see :func:`_compilable`)."""
    return "%json " + json.dumps(_compilable(schema, param), ensure_ascii=False)


@functools.lru_cache(maxsize=256)  # agent loops send the same tool schemas every turn
def _schema_error(text: str) -> str:
    from llguidance import LLMatcher  # the tool grammars are llguidance's dialect

    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(text)).strip()
    except ValueError as exc:
        return str(exc)


def check_schema(schema: Mapping[str, Any], param: str) -> None:
    """Raise a 400 naming ``param`` when llguidance cannot compile ``schema``.

    Pieces are checked one by one so the error names the field at fault; the combined
    grammar is compiled by the guided-decoding backend.
    """
    error = _schema_error(json.dumps(_compilable(schema, param), ensure_ascii=False))
    if error:
        raise InvalidRequestError(f"{param}: the JSON schema cannot be enforced: {error}", param=param)


def check_name(name: str, param: str, what: str = "tool name") -> None:
    """A name the tool parsers would not read back cannot be forced."""
    if not valid_name(name):
        raise InvalidRequestError(f"{param}: the {what} {name!r} cannot appear in a tool call "
                                  "(no whitespace, '<' or '>'; at most 256 characters)", param=param)


def argument_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema a call's arguments must follow.

    Strict tools: their parameters exactly (none declared: an empty object). Others: the
    shape only, each declared property with its declared top-level type and nothing
    undeclared, so a forced call is well-formed without holding the model to a schema
    the client did not ask to be enforced.
    """
    params = tool.parameters
    if tool.strict:
        return dict(params) if params else {"type": "object", "properties": {}, "additionalProperties": False}
    props = params.get("properties")
    if not isinstance(props, dict) or not props:
        return {"type": "object"}
    loose = {}
    for key, prop in props.items():
        types = schema_types(prop) if isinstance(prop, dict) else None
        loose[key] = {"type": sorted(types)} if types else {}
    return {"type": "object", "properties": loose, "additionalProperties": False}


def _answer_rule(answer: GuideSpec) -> str:
    """The answer that is not a call, as the same guide alone would shape it."""
    if answer.kind == "json_object":
        return embedded_json({"type": "object"})
    if answer.kind == "json_schema" and isinstance(answer.value, dict):
        check_schema(answer.value, answer.param)
        return embedded_json(answer.value)
    raise UnsupportedFeatureError(f"{answer.param}: only a JSON object or JSON schema answer can be combined with "
                                  "callable tools", param=answer.param)


@dataclass(frozen=True)
class CallMarkers:
    """How a format's calls are delimited in the grammar, as lark expressions with their
    layout: ``open`` before each call body, ``close`` after it (None: a call ends with its
    body), ``separator`` between parallel calls (None: nothing). ``<tool_call>`` names a
    special token (llguidance's syntax); a quoted string is text. ``spelled``: the
    opening marker's text, which free text may not contain."""

    open: str
    close: Optional[str]
    spelled: str
    separator: Optional[str] = None


def build_grammar(tools: Sequence[ToolSpec], mode: str, body: BodyRules, *, parallel: bool = True,
                  markers: CallMarkers, answer: Optional[GuideSpec] = None) -> GuideSpec:
    """The lark grammar for ``mode`` whose calls are ``body`` rules of ``tools``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not tools:
        raise ValueError("a tool grammar needs at least one tool")
    names = [f"tool_{i}" for i in range(len(tools))]
    rules = [body(tool, name) for tool, name in zip(tools, names)]
    calls = "call" if not parallel else f"call ({markers.separator} call)*" if markers.separator else "call+"
    if mode == "required":
        start = f"start: {calls}"
    elif answer is not None:
        start = f"start: answer | {calls}\nanswer: {_answer_rule(answer)}"
    else:
        start = f"start: TEXT? ({calls})?\nTEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(markers.spelled)}(?s:.*)/"
    close = f" {markers.close}" if markers.close is not None else ""
    lines = [
        "%llguidance {}",
        start,
        f'call: {markers.open} ({" | ".join(names)}){close}',
        *rules,
    ]
    return GuideSpec("lark", "\n".join(lines) + "\n", param=GRAMMAR_PARAM)


_DEFINITIONS = ("$defs", "definitions")


def json_call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one ``{"name": ..., "arguments": {...}}`` call object of ``tool``
    (Hermes' body, and other JSON formats'). Definitions (``$defs`` / ``definitions``) of
    the arguments schema move to the root, so ``$ref`` s into them still resolve."""
    arguments = argument_schema(tool)
    if tool.strict:
        check_schema(arguments, tool.param)
    hoisted = {key: arguments[key] for key in _DEFINITIONS if key in arguments}
    arguments = {k: v for k, v in arguments.items() if k not in hoisted}
    return {
        **hoisted,
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
