"""Qwen3-Coder / Qwen3.5 tool calls written as XML-like blocks.

::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are untyped text; the tool schema guides their conversion
(:func:`ninfer.frontend.tool_schema.convert_parameter`). One newline on each side of a
value is the format's own layout and is removed. A value may contain balanced nested
``<parameter=...>...</parameter>`` text (the literal ``<parameter=`` opens a nesting
level); because the format has no escape, an unbalanced one cannot be read and sends
the region back to text.

The arguments JSON is built parameter by parameter as the body is read. A call commits
once ``<function=NAME>`` names a declared tool and the next tag (``<parameter=``,
``</function>`` or, tolerant, ``</tool_call>``) has arrived. A value whose JSON form is
already fixed streams as it is read: a parameter whose schema admits strings, or an
untyped one whose first non-blank character cannot begin JSON (it stays text). A
newline that may be the closing layout and a possible tag start are held back. Any
other value is written when ``</parameter>`` closes it.
"""

from __future__ import annotations

from ninfer.capabilities import ToolParser
from ninfer.frontend.json_stream import WHITESPACE as JSON_WHITESPACE
from ninfer.frontend.tool_regions import (
    GAP_LIMIT,
    NAME_LIMIT,
    WHITESPACE,
    CallBody,
    Malformed,
    ParsedCall,
    TaggedToolParser,
    expect,
    skip_space,
)
from ninfer.frontend.tool_schema import Conversion, ToolSpec, convert_parameter, dumps_json
from ninfer.hookspecs import hookimpl
from ninfer_plugins.tool_parsers.markers import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from ninfer_plugins.tool_parsers.qwen3_xml_grammar import qwen3_xml_grammar

FUNC = "<function="
FUNC_END = "</function>"
PARAM = "<parameter="
PARAM_END = "</parameter>"

_FUNC, _FUNC_NAME, _PARAMS, _PARAM_NAME, _VALUE = range(5)
_CONTINUE = object()  # a state finished; run the next one
#: characters a JSON text can begin with (after blanks); NaN and Infinity are refused anyway
_JSON_START = frozenset('{["-0123456789tfn')


def _strip_layout(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class _XmlBody:
    def __init__(self, parser: "Qwen3XmlToolParser", start: int):
        self.parser = parser
        self.state = _FUNC
        self.pos = start  # start of what the current state reads
        self.tool: ToolSpec | None = None
        self.name: str | None = None  # set when the call commits
        self.keys: set[str] = set()
        self.key = ""
        self.scan = 0  # value scan cursor
        self.depth = 0  # nested <parameter= levels open inside the value
        # the arguments JSON: pieces so far, how many are taken, members written
        self.pieces = ["{"]
        self.taken = 0
        self.members = 0
        self.consumed = start  # buffer offset past the text the pieces stand for
        self.omitted = self.mismatched = 0
        self.types: frozenset[str] | None = None  # of the parameter being read
        self.live: bool | None = None  # its value streams as a JSON string (None: not known yet)
        self.value_len = 0  # escaped characters of a live value written so far

    def step(self, buf: str, final: bool) -> ParsedCall | Malformed | None:
        handlers = (self._function, self._function_name, self._params, self._param_name, self._value)
        while True:
            result = handlers[self.state](buf, final)
            if result is not _CONTINUE:
                if result is None and self.state == _VALUE:
                    self._stream_value(buf)
                return result  # type: ignore[return-value]

    def take(self) -> str:
        new = "".join(self.pieces[self.taken:])
        self.taken = len(self.pieces)
        return new

    def salvage(self) -> ParsedCall:
        assert self.tool is not None
        closing = '"}' if self.state == _VALUE and self.live else "}"
        return ParsedCall(self.tool.name, "".join(self.pieces) + closing, self.consumed, self.omitted,
                          self.mismatched)

    def _literal(self, buf: str, final: bool, literals: tuple[str, ...]) -> tuple[str | None, int]:
        """The literal after optional whitespace ("" for none, None to wait) and its offset."""
        p = skip_space(buf, self.pos)
        if p - self.pos > GAP_LIMIT:
            return "", self.pos + GAP_LIMIT
        return expect(buf, p, literals, final), p

    def _function(self, buf: str, final: bool) -> object:
        found, p = self._literal(buf, final, (FUNC,))
        if not found:
            return None if found is None else Malformed("malformed_structure", p)
        self.pos, self.state = p + len(FUNC), _FUNC_NAME
        return _CONTINUE

    def _name(self, buf: str, final: bool, reason: str) -> str | Malformed | None:
        """The name running from ``pos`` to ``>``; ``pos`` then moves past the ``>``."""
        limit = self.pos + NAME_LIMIT + 1
        close = buf.find(">", self.pos, limit)
        segment = buf[self.pos:close if close >= 0 else limit]
        bad = next((i for i, c in enumerate(segment) if c in WHITESPACE or c == "<"), None)
        if bad is not None:
            return Malformed(reason, self.pos + bad)
        if close < 0:
            if len(segment) > NAME_LIMIT:
                return Malformed(reason, self.pos + NAME_LIMIT)
            return Malformed("malformed_structure", len(buf)) if final else None
        if not segment:
            return Malformed(reason, close)
        self.pos = close + 1
        return segment

    def _function_name(self, buf: str, final: bool) -> object:
        name = self._name(buf, final, "invalid_tool_name")
        if not isinstance(name, str):
            return name
        self.tool = self.parser.tools.get(name)
        if self.tool is None:
            return Malformed("undeclared_tool", self.pos)
        self.state = _PARAMS
        return _CONTINUE

    def _params(self, buf: str, final: bool) -> object:
        # tolerant: a closing </tool_call> may stand in for a missing </function>
        ends = (PARAM, FUNC_END, TOOL_CALL_CLOSE) if self.parser.tolerant else (PARAM, FUNC_END)
        found, p = self._literal(buf, final, ends)
        if not found:
            return None if found is None else Malformed("malformed_structure", p)
        if self.name is None:  # the header is followed by body markup: the call commits
            assert self.tool is not None
            self.name, self.consumed = self.tool.name, self.pos
        if found == PARAM:
            self.pos, self.state = p + len(PARAM), _PARAM_NAME
            return _CONTINUE
        return self._done(p + len(FUNC_END) if found == FUNC_END else p)

    def _param_name(self, buf: str, final: bool) -> object:
        key = self._name(buf, final, "malformed_structure")
        if not isinstance(key, str):
            return key
        if key in self.keys:
            return Malformed("duplicate_parameter", self.pos)
        assert self.tool is not None
        self.keys.add(key)
        self.key, self.scan, self.depth, self.state = key, self.pos, 0, _VALUE
        self.types = self.tool.parameter_types(key)
        self.live = None if self.types is None else "string" in self.types
        if self.live:
            self._open_string()
        return _CONTINUE

    def _value(self, buf: str, final: bool) -> object:
        while (k := buf.find("<", self.scan)) >= 0:
            if buf.startswith(PARAM_END, k):
                if self.depth == 0:
                    self._close_value(_strip_layout(buf[self.pos:k]))
                    self.pos = self.consumed = k + len(PARAM_END)
                    self.state = _PARAMS
                    return _CONTINUE
                self.depth -= 1
                self.scan = k + len(PARAM_END)
            elif buf.startswith(PARAM, k):
                self.depth += 1
                self.scan = k + len(PARAM)
            elif not final and len(buf) - k < len(PARAM_END) and (
                PARAM_END.startswith(buf[k:]) or PARAM.startswith(buf[k:])
            ):
                self.scan = k  # a tag may be arriving
                return None
            else:
                self.scan = k + 1
        self.scan = len(buf)
        return Malformed("malformed_structure", len(buf)) if final else None

    def _done(self, end: int) -> ParsedCall:
        assert self.tool is not None
        return ParsedCall(self.tool.name, "".join(self.pieces) + "}", end, self.omitted, self.mismatched)

    # -- the arguments JSON ----------------------------------------------------------
    def _member(self, value_json: str) -> None:
        """Write a member (or, for a live value, its opening) after the ones before it."""
        sep = ", " if self.members else ""
        self.pieces.append(f"{sep}{dumps_json(self.key)}: {value_json}")
        self.members += 1

    def _open_string(self) -> None:
        self._member('"')
        self.consumed, self.value_len = self.pos, 0

    def _stream_value(self, buf: str) -> None:
        """Write the part of the value read so far whose JSON form is certain."""
        end = self.scan  # the value scan stops before a possible tag
        if end <= self.pos:
            return  # not even known whether the layout newline comes
        if self.live is None:  # untyped: text unless it could parse as JSON
            first = next((c for c in buf[self.pos:end] if c not in JSON_WHITESPACE), None)
            if first is None:
                return
            self.live = first not in _JSON_START
            if not self.live:
                return
            self._open_string()
        if not self.live:
            return
        start = max(self.consumed, self.pos + (buf[self.pos] == "\n"))  # past the layout newline
        end -= buf[end - 1] == "\n"  # it may be the closing layout newline
        if end > start:
            piece = dumps_json(buf[start:end])[1:-1]
            self.pieces.append(piece)
            self.value_len += len(piece)
            self.consumed = end

    def _close_value(self, text: str) -> None:
        value, how = convert_parameter(text, self.types)
        if how is Conversion.OMITTED:
            self.omitted += 1
            return
        self.mismatched += how is Conversion.MISMATCH
        if not self.live:
            self._member(dumps_json(value))
            return
        assert isinstance(value, str), "a streamed value must stay a string"
        self.pieces.append(dumps_json(value)[1 + self.value_len:])


class Qwen3XmlToolParser(TaggedToolParser):
    """``Qwen3XmlToolParser(tools, tolerant=False)``: see :mod:`ninfer.frontend.tool_regions`."""

    open_marker, close_marker = TOOL_CALL_OPEN, TOOL_CALL_CLOSE

    def new_body(self, start: int) -> CallBody:
        return _XmlBody(self, start)


@hookimpl
def register_tool_parsers(register):
    register(
        ToolParser(
            name="qwen3_xml",
            description="Qwen3-Coder/Qwen3.5 <function=...><parameter=...> tool calls",
            factory=Qwen3XmlToolParser,
            grammar=qwen3_xml_grammar,
        )
    )
