"""A tool call written as one JSON object, read as it streams: :class:`JsonCallBody`.

Most tool-call formats put one JSON object per call after (or between) their markers,
``{"name": "NAME", "arguments": {...}}``; a tool-call parser built on
:class:`ninfer.frontend.tool_regions.TaggedToolParser` returns this body from its
``new_body`` and only names its markers.

The object is scanned structurally as it arrives so that prose which merely mentions
the marker is released quickly (a character JSON cannot have outside a string, or a raw
line break inside one, ends the attempt); the complete object is then parsed strictly
(:func:`ninfer.frontend.tool_schema.loads_json`: no repeated member names, no NaN).

Tolerant parsers also follow the object's members as they arrive (:class:`_Members`):
the call commits once its name member names a declared tool, and the arguments object
streams re-serialised by :class:`ninfer.frontend.json_stream.JsonWriter`, piece by piece.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container

from ninfer.frontend.json_stream import JsonWriter
from ninfer.frontend.tool_regions import GAP_LIMIT, Malformed, ParsedCall, expect, skip_space, valid_name
from ninfer.frontend.tool_schema import DuplicateKeyError, dumps_json, loads_json

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

    def __init__(self, tools: Container[str], begin: int, keys: tuple[str, str]):
        self.tools = tools  # the declared names
        self.keys = keys  # the name's and the arguments' member names
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
        elif mode == _VALUE and self.key == self.keys[0] and c == '"':
            self.string, self.mode = JsonWriter(self.pos), _NAME
        elif mode == _VALUE and self.key == self.keys[1] and c == "{":
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
        """A member name, or the name member's value, has been read."""
        if self.mode == _KEY_STRING:
            expected = value in self.keys and value not in self.seen
            self.seen.add(value)
            self.key, self.mode = value, _COLON if expected else _STOPPED
        elif valid_name(value) and value in self.tools:
            self.name, self.consumed, self.mode = value, self.pos, _AFTER  # the call commits
        else:
            self.mode = _STOPPED


class JsonCallBody:
    """The :class:`ninfer.frontend.tool_regions.CallBody` of a call written as one JSON object.

    ``JsonCallBody(tools, tolerant, start)``: ``tools`` holds the declared tool names (a
    parser's ``self.tools``), ``start`` is where the body begins in the parser's buffer.
    ``keys`` names the object's two members, ``("name", "arguments")`` by default
    (Hermes, Qwen, Mistral); Llama 3's ``<|python_tag|>`` calls use ``("name", "parameters")``.
    No other member is allowed, the arguments must be an object, and they are returned
    re-serialised by :func:`ninfer.frontend.tool_schema.dumps_json` in the model's member
    order.
    """

    def __init__(self, tools: Container[str], tolerant: bool, start: int,
                 keys: tuple[str, str] = ("name", "arguments")):
        self.tools, self.tolerant, self.keys = tools, tolerant, keys
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
            if self.tolerant:
                self.members = _Members(self.tools, p, self.keys)
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
        name, args = obj.get(self.keys[0]), obj.get(self.keys[1], {})
        if set(obj) - set(self.keys) or not isinstance(name, str) or not isinstance(args, dict):
            return Malformed("malformed_structure", end)
        if not valid_name(name):
            return Malformed("invalid_tool_name", end)
        if name not in self.tools:
            return Malformed("undeclared_tool", end)
        return ParsedCall(name, dumps_json(args), end)
