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
"""

from __future__ import annotations

from ninfer.capabilities import ToolParser
from ninfer.frontend.tool_regions import (
    CLOSE,
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

FUNC = "<function="
FUNC_END = "</function>"
PARAM = "<parameter="
PARAM_END = "</parameter>"

_FUNC, _FUNC_NAME, _PARAMS, _PARAM_NAME, _VALUE = range(5)
_CONTINUE = object()  # a state finished; run the next one


def _strip_layout(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class _XmlBody:
    def __init__(self, parser: "Qwen3XmlToolParser", start: int):
        self.parser = parser
        self.state = _FUNC
        self.pos = start  # start of what the current state reads
        self.tool: ToolSpec | None = None
        self.params: dict[str, str] = {}
        self.key = ""
        self.scan = 0  # value scan cursor
        self.depth = 0  # nested <parameter= levels open inside the value

    def step(self, buf: str, final: bool) -> ParsedCall | Malformed | None:
        handlers = (self._function, self._function_name, self._params, self._param_name, self._value)
        while True:
            result = handlers[self.state](buf, final)
            if result is not _CONTINUE:
                return result  # type: ignore[return-value]

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
        ends = (PARAM, FUNC_END, CLOSE) if self.parser.tolerant else (PARAM, FUNC_END)
        found, p = self._literal(buf, final, ends)
        if not found:
            return None if found is None else Malformed("malformed_structure", p)
        if found == PARAM:
            self.pos, self.state = p + len(PARAM), _PARAM_NAME
            return _CONTINUE
        return self._done(p + len(FUNC_END) if found == FUNC_END else p)

    def _param_name(self, buf: str, final: bool) -> object:
        key = self._name(buf, final, "malformed_structure")
        if not isinstance(key, str):
            return key
        if key in self.params:
            return Malformed("duplicate_parameter", self.pos)
        self.key, self.scan, self.depth, self.state = key, self.pos, 0, _VALUE
        return _CONTINUE

    def _value(self, buf: str, final: bool) -> object:
        while (k := buf.find("<", self.scan)) >= 0:
            if buf.startswith(PARAM_END, k):
                if self.depth == 0:
                    self.params[self.key] = _strip_layout(buf[self.pos:k])
                    self.pos, self.state = k + len(PARAM_END), _PARAMS
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
        args: dict[str, object] = {}
        omitted = mismatched = 0
        for key, raw in self.params.items():
            value, how = convert_parameter(raw, self.tool.parameter_types(key))
            if how is Conversion.OMITTED:
                omitted += 1
                continue
            mismatched += how is Conversion.MISMATCH
            args[key] = value
        return ParsedCall(self.tool.name, dumps_json(args), end, omitted, mismatched)


class Qwen3XmlToolParser(TaggedToolParser):
    """``Qwen3XmlToolParser(tools, tolerant=False)``: see :mod:`ninfer.frontend.tool_regions`."""

    def new_body(self, start: int) -> CallBody:
        return _XmlBody(self, start)


@hookimpl
def register_tool_parsers(register):
    register(
        ToolParser(
            name="qwen3_xml",
            description="Qwen3-Coder/Qwen3.5 <function=...><parameter=...> tool calls",
            factory=Qwen3XmlToolParser,
        )
    )
