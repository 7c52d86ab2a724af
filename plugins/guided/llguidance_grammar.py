"""Translating a :class:`~ninfer.guided.spec.GuideSpec` into llguidance grammar text.

llguidance treats every added token of a tokenizer (``<tool_call>``, ``<think>``, chat
markers) as a special token that plain text never matches. Literal text we put into a
grammar (choices, structural-tag begin/end strings) is therefore split around those
tokens, which are then referenced by id (``<[id]>``), so a guide can ask for the very
token the model was trained to emit.

User patterns (the regex guide, JSON Schema ``pattern``) are ECMA-262; they are rewritten
into the Rust syntax llguidance reads (:mod:`ninfer.guided.ecma_regex`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from ninfer.errors import InvalidRequestError
from ninfer.guided.ecma_regex import PatternError, ecma_to_rust
from ninfer.guided.schema_patterns import schema_with_rust_patterns
from ninfer.guided.spec import GuideSpec

#: JSON layout the schema modes produce unless a schema's ``x-guidance`` says otherwise:
#: one line with the separators ``json.dumps`` writes. Flexible whitespace lets a weak
#: model pad forever; this keeps every JSON answer short and parseable.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SpecialTokens:
    """The tokenizer's added tokens, for writing literals that contain them."""

    def __init__(self, added: Mapping[str, int]):
        self.ids = dict(added)
        longest_first = sorted(self.ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if longest_first else None

    def literal(self, text: str) -> str:
        """A lark expression matching exactly ``text`` (added tokens as themselves)."""
        parts = self._split.split(text) if self._split else [text]
        out = [f"<[{self.ids[p]}]>" if p in self.ids else json.dumps(p) for p in parts if p]
        return " ".join(out) if out else '""'

    def single(self, text: str) -> int | None:
        return self.ids.get(text)


def grammar_for(spec: GuideSpec, special: SpecialTokens) -> str:
    """The llguidance grammar of ``spec``; a value of the wrong shape is the client's error."""
    kind, value = spec.kind, spec.value
    if kind == "json_object":
        return _json_grammar({"type": "object"}, spec.param)
    if kind == "json_schema":
        return _json_grammar(_need(value, dict, "a JSON Schema object", spec.param), spec.param)
    if kind == "regex":
        pattern = _need(value, str, "a regular expression string", spec.param)
        try:
            return LLMatcher.grammar_from_regex(ecma_to_rust(pattern))
        except PatternError as e:
            raise InvalidRequestError(f"invalid regex: {e}", param=spec.param) from None
    if kind in ("ebnf", "lark"):
        text = _need(value, str, "a grammar string", spec.param)
        if kind == "ebnf":
            try:
                text = any_to_lark(text)  # GBNF (llama.cpp) to lark; lark text passes through
            except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions
                raise InvalidRequestError(f"invalid grammar: {e}", param=spec.param) from None
        return LLMatcher.grammar_from_lark(text)
    if kind == "choice":
        choices = _need(value, list, "a non-empty array of strings", spec.param)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError("must be a non-empty array of strings", param=spec.param)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(special.literal(c) for c in choices))
    if kind == "structural_tag":
        tag = _need(value, dict, "an object", spec.param)
        return LLMatcher.grammar_from_lark(_structural_tag(tag, special, spec.param))
    raise InvalidRequestError(f"unknown guide kind {kind!r}", param=spec.param)


def _need(value: Any, kind: type, what: str, param: str) -> Any:
    if not isinstance(value, kind):
        raise InvalidRequestError(f"must be {what}", param=param)
    return value


def _json_grammar(schema: dict, param: str) -> str:
    schema = _rust_patterns(schema, param)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise InvalidRequestError(f"invalid JSON schema: {e}", param=param) from None


def _rust_patterns(schema: dict, param: str) -> dict:
    """``schema`` with its ECMA patterns in Rust syntax (llguidance would read ``\\s`` as Unicode)."""
    try:
        return schema_with_rust_patterns(schema)
    except PatternError as e:
        raise InvalidRequestError(f"invalid JSON schema: pattern at {e}", param=param) from None


def _with_layout(schema: dict) -> dict:
    """The schema with our JSON layout unless it chooses its own (for ``%json`` inside lark)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def _structural_tag(value: dict, special: SpecialTokens, param: str) -> str:
    """Free text in which every trigger starts a tagged segment whose body follows a schema.

    ``value`` is ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``
    (a ``"type": "structural_tag"`` key may be present): each structure's ``begin``
    starts with one of the triggers. Outside segments the text is free; the output may
    end after any complete segment.
    """
    triggers = value.get("triggers")
    structures = value.get("structures")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidRequestError("must be a non-empty array of non-empty strings", param=f"{param}.triggers")
    if not (isinstance(structures, list) and structures):
        raise InvalidRequestError("must be a non-empty array of {begin, schema, end} objects",
                                  param=f"{param}.structures")
    rules = []
    for i, s in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict)):
            raise InvalidRequestError("must be an object with string begin and end and an object schema", param=where)
        begin, end = s["begin"], s["end"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidRequestError(f"begin {begin!r} starts with none of the triggers", param=f"{where}.begin")
        schema = json.dumps(_with_layout(_rust_patterns(s["schema"], f"{where}.schema")))
        body = f"{special.literal(begin[len(trigger):])} %json {schema} {special.literal(end)}"
        token = special.single(trigger)
        if token is not None:  # the trigger is one added token: the segment starts at it
            rules.append(f"tag_{i}: TEXT <[{token}]> {body}")
        else:  # text trigger: free text up to its first occurrence
            rules += [f"tag_{i}_trigger[lazy]: TEXT {json.dumps(trigger)}", f"tag_{i}: tag_{i}_trigger {body}"]
    tags = " | ".join(f"tag_{i}" for i in range(len(structures)))
    return "\n".join(["%llguidance {}", f"start: ({tags})* TEXT", r"TEXT: /(.|\n)*/", *rules]) + "\n"
