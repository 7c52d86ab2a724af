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

Tolerant parsers also follow the object's members as they arrive (:class:`_Members`):
the call commits once its ``"name"`` string names a declared tool, and the
``"arguments"`` object streams re-serialised by
:class:`ninfer.frontend.json_stream.JsonWriter`, piece by piece.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container

from ninfer.capabilities import ToolParser
from ninfer.frontend.json_stream import JsonWriter
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
from ninfer_plugins.tool_parsers.hermes_json_grammar import hermes_grammar
from ninfer_plugins.tool_parsers.markers import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

#: characters JSON allows outside strings
_OUTSIDE = frozenset(' \t\r\n{}[]:,-+.0123456789eE"truefalsn')
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_PAIRS = {"}": "{", "]": "["}
_SPACE_RUN = re.compile(r"[ \t\n\r]*")

_KEY, _KEY_STRING, _COLON, _VALUE, _NAME, _ARGUMENTS, _AFTER, _END, _STOPPED = range(9)


class _Members:
    """Follows the call object's members from its ``{`` at offset ``begin`` (tolerant mode).

    Before the call commits, anything unexpected just stops the follower and leaves the
    verdict to the strict parse. After it, :meth:`feed` reports the break at once.
    """

    def __init__(self, tools: Container[str], begin: int):
        self.tools = tools  # the declared names
        self.pos = begin + 1
        self.mode = _KEY
        self.first = True  # no member yet: "}" may close the object
        self.seen: set[str] = set()
        self.key = ""
        self.string: JsonWriter | None = None  # a member name or the "name" value being read
        self.name: str | None = None
        self.arguments: JsonWriter | None = None
        self.consumed = begin  # buffer offset past the text the call's arguments stand for

    def feed(self, buf: str) -> bool:
        """Follow the object up to the end of ``buf``; True when a committed call broke."""
        while self.mode not in (_END, _STOPPED) and self.pos < len(buf) and self._step(buf):
            pass
        return self.mode == _STOPPED and self.name is not None

    def _step(self, buf: str) -> bool:
        if self.mode in (_KEY_STRING, _NAME, _ARGUMENTS):
            return self._in_value(buf)
        self.pos = _SPACE_RUN.match(buf, self.pos).end()  # type: ignore[union-attr]
        if self.pos == len(buf):
            return False
        c, mode, first = buf[self.pos], self.mode, self.first
        self.first = False
        if mode == _KEY and c == '"':
            self.string, self.mode = JsonWriter(self.pos), _KEY_STRING
        elif mode == _COLON and c == ":":
            self.pos, self.mode = self.pos + 1, _VALUE
        elif mode == _VALUE and self.key == "name" and c == '"':
            self.string, self.mode = JsonWriter(self.pos), _NAME
        elif mode == _VALUE and self.key == "arguments" and c == "{":
            self.arguments, self.mode = JsonWriter(self.pos), _ARGUMENTS
        elif mode == _AFTER and c == ",":
            self.pos, self.mode = self.pos + 1, _KEY
        elif (mode == _AFTER or mode == _KEY and first) and c == "}":
            self.mode = _END  # complete: the strict parse of the whole object takes over
        else:
            self.mode = _STOPPED
        return self.mode != _STOPPED

    def _in_value(self, buf: str) -> bool:
        writer = self.arguments if self.mode == _ARGUMENTS else self.string
        assert writer is not None
        writer.feed(buf)
        self.pos = writer.pos
        if self.mode == _ARGUMENTS:
            self.consumed = max(self.consumed, writer.consumed)
        if writer.failed:
            self.mode = _STOPPED
        elif writer.done and self.mode == _ARGUMENTS:
            self.mode = _AFTER
        elif writer.done:
            self._string_done(json.loads(writer.text()))
        return writer.done and self.mode != _STOPPED

    def _string_done(self, value: str) -> None:
        """A member name, or the ``"name"`` value, has been read."""
        if self.mode == _KEY_STRING:
            expected = value in ("name", "arguments") and value not in self.seen
            self.seen.add(value)
            self.key, self.mode = value, _COLON if expected else _STOPPED
        elif valid_name(value) and value in self.tools:
            self.name, self.consumed, self.mode = value, self.pos, _AFTER  # the call commits
        else:
            self.mode = _STOPPED


class _JsonBody:
    def __init__(self, parser: "HermesJsonToolParser", start: int):
        self.parser = parser
        self.pos = start
        self.begin = -1  # offset of the object's opening brace, once seen
        self.scan = 0
        self.stack: list[str] = []
        self.in_string = False
        self.escaped = False
        self.members: _Members | None = None  # tolerant only

    @property
    def name(self) -> str | None:
        return None if self.members is None else self.members.name

    def take(self) -> str:
        args = None if self.members is None else self.members.arguments
        return "" if args is None else args.take()

    def salvage(self) -> ParsedCall:
        members = self.members
        assert members is not None and members.name is not None
        args = members.arguments
        text = "{}" if args is None else args.text() + args.closers()
        return ParsedCall(members.name, text, members.consumed)

    def step(self, buf: str, final: bool) -> ParsedCall | Malformed | None:
        if self.begin < 0:
            p = skip_space(buf, self.pos)
            found = expect(buf, p, ("{",), final) if p - self.pos <= GAP_LIMIT else ""
            if not found:
                return None if found is None else Malformed("malformed_structure", min(p, self.pos + GAP_LIMIT))
            self.begin = self.scan = p
            if self.parser.tolerant:
                self.members = _Members(self.parser.tools, p)
        # the follower goes first: it fails no later than the scan below, so a committed
        # call breaks at the same point however the text was chunked
        if self.members is not None and self.members.feed(buf):
            return Malformed("malformed_structure", self.members.consumed)
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

    open_marker, close_marker = TOOL_CALL_OPEN, TOOL_CALL_CLOSE

    def new_body(self, start: int) -> CallBody:
        return _JsonBody(self, start)


@hookimpl
def register_tool_parsers(register):
    register(
        ToolParser(
            name="hermes_json",
            description='Qwen3/Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> tool calls',
            factory=HermesJsonToolParser,
            grammar=hermes_grammar,
        )
    )
