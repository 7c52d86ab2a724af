"""Qwen3 / Hermes tool calls written as one JSON object per tag pair.

::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

The object is scanned structurally as it arrives so that prose which merely mentions
the tag is released quickly (a character JSON cannot have outside a string, or a raw
line break inside one, ends the attempt); the complete object is then parsed strictly.
Arguments are re-serialised with :func:`ninfer.frontend.tool_schema.dumps_json`,
keeping the model's member order.
"""

from __future__ import annotations

import re

from ninfer.capabilities import ToolParser
from ninfer.frontend.tool_regions import (
    GAP_LIMIT,
    CallBody,
    Malformed,
    ParsedCall,
    TaggedToolParser,
    expect,
    skip_space,
    valid_name,
)
from ninfer.frontend.tool_schema import DuplicateKeyError, dumps_json, loads_json
from ninfer.hookspecs import hookimpl

#: characters JSON allows outside strings
_OUTSIDE = frozenset(' \t\r\n{}[]:,-+.0123456789eE"truefalsn')
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_PAIRS = {"}": "{", "]": "["}


class _JsonBody:
    def __init__(self, parser: "HermesJsonToolParser", start: int):
        self.parser = parser
        self.pos = start
        self.begin = -1  # offset of the object's opening brace, once seen
        self.scan = 0
        self.stack: list[str] = []
        self.in_string = False
        self.escaped = False

    def step(self, buf: str, final: bool) -> ParsedCall | Malformed | None:
        if self.begin < 0:
            p = skip_space(buf, self.pos)
            found = expect(buf, p, ("{",), final) if p - self.pos <= GAP_LIMIT else ""
            if not found:
                return None if found is None else Malformed("malformed_structure", min(p, self.pos + GAP_LIMIT))
            self.begin = self.scan = p
        end = self._scan(buf)
        if isinstance(end, Malformed):
            return end
        if end is None:
            return Malformed("malformed_structure", len(buf)) if final else None
        return self._parse(buf[self.begin:end], end)

    def _scan(self, buf: str) -> int | Malformed | None:
        """Offset just past the object once its braces balance."""
        i, n = self.scan, len(buf)
        while i < n:
            c = buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif (run := _STRING_RUN.match(buf, i)) is not None:
                    i = run.end()
                    continue
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                else:  # a raw control character (line break) cannot be inside a JSON string
                    return Malformed("malformed_structure", i)
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                if not self.stack or self.stack.pop() != _PAIRS[c]:
                    return Malformed("malformed_structure", i)
                if not self.stack:
                    self.scan = i + 1
                    return i + 1
            elif c not in _OUTSIDE:
                return Malformed("malformed_structure", i)
            i += 1
        self.scan = i
        return None

    def _parse(self, text: str, end: int) -> ParsedCall | Malformed:
        try:
            obj = loads_json(text)
        except DuplicateKeyError:
            return Malformed("duplicate_parameter", end)
        except ValueError:
            return Malformed("malformed_structure", end)
        name, args = obj.get("name"), obj.get("arguments", {})
        if set(obj) - {"name", "arguments"} or not isinstance(name, str) or not isinstance(args, dict):
            return Malformed("malformed_structure", end)
        if not valid_name(name):
            return Malformed("invalid_tool_name", end)
        if name not in self.parser.tools:
            return Malformed("undeclared_tool", end)
        return ParsedCall(name, dumps_json(args), end)


class HermesJsonToolParser(TaggedToolParser):
    """``HermesJsonToolParser(tools, tolerant=False)``: see :mod:`ninfer.frontend.tool_regions`."""

    def new_body(self, start: int) -> CallBody:
        return _JsonBody(self, start)


@hookimpl
def register_tool_parsers(register):
    register(
        ToolParser(
            name="hermes_json",
            description='Qwen3/Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> tool calls',
            factory=HermesJsonToolParser,
        )
    )
