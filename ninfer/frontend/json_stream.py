"""Re-serialise one JSON value while its raw text is still arriving.

Tool arguments are returned in one canonical form (:func:`ninfer.frontend.tool_schema.dumps_json`
of the parsed value), whatever spacing or escapes the model used. :class:`JsonWriter`
produces that same text piece by piece, so a call's arguments can stream before the
value is complete: a piece is written only once no later text can change it. Open
strings stream character by character (an escape is held until it is complete, and a
high surrogate until it is known whether a low one follows); a number or ``true`` /
``false`` / ``null`` is written once the character after it arrives; a separator or
member name waits for the value that follows it. What has been written is therefore
always a prefix of the final text, and :meth:`JsonWriter.closers` turns it into valid
JSON if the value breaks off.

The writer accepts exactly the values :func:`ninfer.frontend.tool_schema.loads_json`
accepts (no NaN or infinities, no repeated member names, no lone surrogates, no nesting
past ``MAX_JSON_DEPTH``), fails at the first character that rules the text out, and stops
reading after the value's last character.
"""

from __future__ import annotations

import json
import re

from ninfer.frontend.tool_schema import MAX_JSON_DEPTH, dumps_json, loads_json

WHITESPACE = " \t\n\r"
_WS_RUN = re.compile(r"[ \t\n\r]+")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u([0-9a-fA-F]{4}))')
_LOW_ESCAPE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_PARTIAL_ESCAPE = re.compile(r'\\(?:u[0-9a-fA-F]{0,3})?\Z')
_SCALAR_RUN = re.compile(r"[-+.eE0-9]+|[a-z]+")
_SCALAR_START = frozenset("-0123456789tfn")
_CLOSER = {"{": "}", "[": "]"}

_VALUE, _KEY, _COLON, _AFTER, _STRING, _KEY_STRING, _SCALAR = range(7)


class JsonWriter:
    """Canonical text of the JSON value starting at raw offset ``start`` of a growing buffer.

    Call :meth:`feed` with the whole buffer each time it grows; read new output with
    :meth:`take`. ``done`` is set after the value's last character, ``failed`` at the
    first character no JSON value can have there. ``consumed`` is the raw offset just
    past the text the output stands for (pending separators, names and scalars excluded).
    """

    def __init__(self, start: int):
        self.pos = start  # next raw offset to read
        self.consumed = start
        self.done = False
        self.failed = False
        self._out: list[str] = []
        self._taken = 0
        self._stack: list[tuple[str, set[str]]] = []  # open containers; objects keep their names
        self._mode = _VALUE
        self._first = False  # just after an opener: the closer may follow at once
        self._prefix = ""  # separator and member name waiting for their value
        self._token = 0  # raw offset where a member name or scalar began
        self._segment = 0  # raw offset where the unwritten part of an open string begins

    def feed(self, buf: str) -> None:
        while not (self.done or self.failed) and self.pos < len(buf) and self._step(buf):
            pass

    def take(self) -> str:
        """Output written since the previous call."""
        new = "".join(self._out[self._taken:])
        self._taken = len(self._out)
        return new

    def text(self) -> str:
        """All output so far."""
        return "".join(self._out)

    def closers(self) -> str:
        """What turns the output so far into a complete JSON value."""
        quote = '"' if self._mode == _STRING else ""
        return quote + "".join(_CLOSER[kind] for kind, _ in reversed(self._stack))

    # -- one step: False when more text is needed ------------------------------------
    def _step(self, buf: str) -> bool:
        mode = self._mode
        if mode == _STRING:
            return self._string(buf)
        if mode == _KEY_STRING:
            return self._key_string(buf)
        if mode == _SCALAR:
            return self._scalar(buf)
        if (ws := _WS_RUN.match(buf, self.pos)) is not None:
            self.pos = ws.end()
            return True
        c = buf[self.pos]
        top = self._stack[-1][0] if self._stack else ""
        first, self._first = self._first, False
        if first and c == _CLOSER.get(top):
            self._close()
        elif mode == _VALUE:
            self._value_start(c)
        elif mode == _KEY and c == '"':
            self._token, self.pos, self._mode = self.pos, self.pos + 1, _KEY_STRING
        elif mode == _COLON and c == ":":
            self.pos, self._mode = self.pos + 1, _VALUE
        elif mode == _AFTER and c == ",":
            self.pos, self._prefix, self._mode = self.pos + 1, ", ", _KEY if top == "{" else _VALUE
        elif mode == _AFTER and c == _CLOSER.get(top):
            self._close()
        else:
            self.failed = True
        return not self.failed

    def _write(self, text: str, consumed: int) -> None:
        self._out.append(self._prefix + text)
        self._prefix, self.consumed = "", consumed

    def _value_start(self, c: str) -> None:
        if c == '"':
            self.pos += 1
            self._write('"', self.pos)
            self._segment, self._mode = self.pos, _STRING
        elif c in _CLOSER:
            if len(self._stack) >= MAX_JSON_DEPTH:
                self.failed = True
                return
            self.pos += 1
            self._write(c, self.pos)
            self._stack.append((c, set()))
            self._mode, self._first = (_KEY if c == "{" else _VALUE), True
        elif c in _SCALAR_START:
            self._token, self._mode = self.pos, _SCALAR
        else:
            self.failed = True

    def _close(self) -> None:
        kind, _ = self._stack.pop()
        self.pos += 1
        self._write(_CLOSER[kind], self.pos)
        self._value_end()

    def _value_end(self) -> None:
        self._mode = _AFTER
        self.done = not self._stack

    # -- strings -------------------------------------------------------------------
    def _string_end(self, buf: str) -> int | None:
        """Scan an open string from ``pos``: the offset of its closing quote, or None.

        ``pos`` ends at the quote, or where reading stopped: the buffer's end, an escape
        that is incomplete (or a high surrogate whose partner may still come), or the
        character that set ``failed`` (a raw control character or a bad escape).
        """
        i, n = self.pos, len(buf)
        while i < n:
            if (run := _STRING_RUN.match(buf, i)) is not None:
                i = run.end()
                continue
            if buf[i] == '"':
                self.pos = i
                return i
            escape = _ESCAPE.match(buf, i) if buf[i] == "\\" else None
            if escape is None:
                self.failed = _PARTIAL_ESCAPE.match(buf, i) is None
                break
            code = int(escape.group(1), 16) if escape.group(1) else 0
            if 0xD800 <= code <= 0xDFFF:  # json joins a high and a following low escape into one character
                low = _LOW_ESCAPE.match(buf, escape.end()) if code <= 0xDBFF else None
                if low is not None:
                    i = low.end()
                    continue
                after = buf[escape.end():escape.end() + 6]
                # a lone surrogate is no text (loads_json refuses it); a high one's partner may still come
                self.failed = code > 0xDBFF or len(after) == 6 or not (
                    "\\u".startswith(after) or after.startswith("\\u"))
                break
            i = escape.end()
        self.pos = i
        return None

    def _string(self, buf: str) -> bool:
        end = self._string_end(buf)
        if self.pos > self._segment:  # the decoded piece, re-escaped the canonical way
            decoded = json.loads('"' + buf[self._segment:self.pos] + '"')
            self._write(dumps_json(decoded)[1:-1], self.pos)
            self._segment = self.pos
        if end is None:
            return False
        self.pos = end + 1
        self._write('"', self.pos)
        self._value_end()
        return True

    def _key_string(self, buf: str) -> bool:
        end = self._string_end(buf)
        if end is None:
            return False
        self.pos = end + 1
        try:
            name = json.loads(buf[self._token:self.pos])
        except ValueError:
            self.failed = True
            return False
        names = self._stack[-1][1]
        if name in names:  # loads_json refuses repeated member names
            self.failed = True
            return False
        names.add(name)
        self._prefix += dumps_json(name) + ": "
        self._mode = _COLON
        return True

    # -- numbers and literals --------------------------------------------------------
    def _scalar(self, buf: str) -> bool:
        run = _SCALAR_RUN.match(buf, self._token)
        assert run is not None
        if run.end() == len(buf):
            self.pos = len(buf)
            return False  # the next character may continue it
        try:
            value = loads_json(run.group())
        except ValueError:
            self.failed = True
            return False
        self.pos = run.end()
        self._write(dumps_json(value), self.pos)
        self._value_end()
        return True
