"""Machinery shared by tool parsers whose calls follow an opening marker.

A parser names its markers (Qwen's and Hermes' ``<tool_call>`` ... ``</tool_call>``;
a format such as ``[TOOL_CALLS]`` or ``<|python_tag|>`` has an opening marker only, and
then each call ends where its body does) and supplies a body parser; the state machine
below is the same for all of them.

Answer text streams out at once. Only two things are held back: a suffix that could
still grow into the opening marker (plus the whitespace just before it, which separates
prose from a call), and a call region until its structure is decided.

Rules for what surrounds the calls (the region is everything from the first call to
the end of the output):

* strict (default): a region is never streamed as calls before it is known to be
  valid, so markup that turns out to be malformed goes back out as ordinary text with
  every byte in place. After a call only whitespace and further calls may follow.
  Calls are therefore released when the output ends; text after a call, a missing
  closing tag or any malformed later call returns the whole region to text.
* tolerant (``--tolerant-tool-calls``): a call streams as soon as its header names a
  declared tool (the body decides when that is): the start first, then its arguments
  JSON in pieces as each becomes certain. From then on the call is committed. If its
  body later turns out malformed, or the output ends inside it, the call is closed with
  the arguments streamed so far, completed into a valid JSON object (open strings and
  containers closed), and the raw text after the last byte those arguments stand for
  goes out as ordinary text (diagnostic reason ``truncated_call``). A call that breaks
  before its header commits it, a missing or garbled closing tag and text after a call
  stay text while the complete calls are kept.

Whitespace separating a released call from text or from another call is formatting
and is dropped; a region that falls back returns with its separating whitespace.
Scanning resumes right after the point of failure, so a real call later in the same
text is still found.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Iterable, Protocol

from ninfer.frontend.output_split import (
    Delta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallParseStats,
    ToolCallStart,
    coalesce,
    partial_suffix,
)
from ninfer.frontend.tool_schema import ToolSpec

WHITESPACE = " \t\r\n"
#: whitespace before an opening marker held back as a possible prose/call separator
SEPARATOR_LIMIT = 32
#: whitespace allowed between structural parts of a call; more is malformed
GAP_LIMIT = 256
#: longest tool or parameter name accepted
NAME_LIMIT = 256


@dataclass(frozen=True)
class Malformed:
    reason: str
    at: int  # buffer offset where scanning resumes as ordinary text


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments JSON object
    end: int  # buffer offset just past the call body
    omitted: int = 0
    mismatched: int = 0


class CallBody(Protocol):
    """Parses one call body, resuming where it stopped; offsets index the parser buffer.

    ``name`` is set once the text read so far commits the call to a declared tool;
    from then on :meth:`take` yields the arguments JSON as it becomes certain (every
    piece a prefix of what follows). Only tolerant parsers stream, but bodies keep this
    up in both modes.
    """

    name: str | None

    def step(self, buf: str, final: bool) -> ParsedCall | Malformed | None:
        """None while more text is needed (never when ``final``)."""

    def take(self) -> str:
        """Arguments text that became certain since the previous call."""

    def salvage(self) -> ParsedCall:
        """A committed call whose body broke: the arguments taken so far completed into
        a JSON object, ending (``end``) where the text those arguments stand for ends."""


def skip_space(buf: str, pos: int, limit: int = GAP_LIMIT + 1) -> int:
    """Offset of the first non-whitespace at or after ``pos``, looking at most ``limit`` ahead."""
    end = min(len(buf), pos + limit)
    while pos < end and buf[pos] in WHITESPACE:
        pos += 1
    return pos


def expect(buf: str, pos: int, literals: tuple[str, ...], final: bool) -> str | None:
    """The literal at ``pos``; None when the text so far could still become one; "" when none can."""
    rest = buf[pos:]
    for lit in literals:
        if rest.startswith(lit):
            return lit
    if not final and any(lit.startswith(rest) for lit in literals):
        return None
    return ""


def valid_name(name: str) -> bool:
    return 0 < len(name) <= NAME_LIMIT and not any(c in name for c in WHITESPACE + "<>")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_TEXT, _BODY, _CLOSE, _AFTER = range(4)


class TaggedToolParser:
    """Incremental parser base: subclasses supply :meth:`new_body` for their body syntax
    and their markers (``open_marker``; ``close_marker``, or None when a call ends with
    its body), as class attributes or arguments."""

    open_marker: str
    close_marker: str | None

    def __init__(self, tools: Iterable[ToolSpec], tolerant: bool = False, *, open_marker: str | None = None,
                 close_marker: str | None = "") -> None:
        if open_marker is not None:
            self.open_marker = open_marker
        if close_marker != "":  # "" keeps the class's; None means no closing marker
            self.close_marker = close_marker
        if not getattr(self, "open_marker", None) or not hasattr(self, "close_marker"):
            raise TypeError(f"{type(self).__name__} must name its open_marker and close_marker (None for none)")
        self.tools = {t.name: t for t in tools}
        self.tolerant = tolerant
        self.stats = ToolCallParseStats()
        self._buf = ""  # undecided text; in a strict region it starts at the region
        self._mode = _TEXT
        self._pos = 0  # scan cursor in the close and after-call modes
        self._body: CallBody | None = None
        self._call: ParsedCall | None = None  # body parsed, closing tag pending
        self._held: list[ParsedCall] = []  # strict: complete calls awaiting the end
        self._index = 0
        self._streamed: list[str] | None = None  # tolerant: arguments sent for the open call

    def new_body(self, start: int) -> CallBody:
        """A body parser for the call whose body starts at buffer offset ``start``."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        out = self._run(final=True)
        assert not self._buf and self._mode == _TEXT
        return out

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        step = (self._text, self._in_body, self._closing, self._after)
        while step[self._mode](final, out):
            pass
        return coalesce(out)

    def _text(self, final: bool, out: list[Delta]) -> bool:
        buf, marker = self._buf, self.open_marker
        i = buf.find(marker)
        end = i if i >= 0 else len(buf) - (0 if final else partial_suffix(buf, marker))
        sep = end
        while (i >= 0 or not final) and sep > 0 and buf[sep - 1] in WHITESPACE and end - sep < SEPARATOR_LIMIT:
            sep -= 1
        out.append(TextDelta(buf[:sep]))
        self._buf = buf[sep:]
        if i < 0:
            return False
        self.stats.marker_seen = True
        self._body = self.new_body(i - sep + len(marker))
        self._mode = _BODY
        return True

    def _in_body(self, final: bool, out: list[Delta]) -> bool:
        body = self._body
        assert body is not None
        result = body.step(self._buf, final)
        if self.tolerant and body.name is not None:
            self._stream(body, out)
        if result is None:
            assert not final
            return False
        if isinstance(result, Malformed) and self._streamed is not None:
            call = body.salvage()  # committed: close it and scan what follows afresh
            self.stats.fell_back("truncated_call")
            out.extend(self._release(call))
            self._buf, self._pos, self._body, self._mode = self._buf[call.end:], 0, None, _AFTER
        elif isinstance(result, Malformed):
            self._fall_back(result.reason, result.at, out)
        else:
            self._call, self._pos, self._mode = result, result.end, _CLOSE
        return True

    def _stream(self, body: CallBody, out: list[Delta]) -> None:
        """Start the committed call once, then send its newly certain arguments."""
        assert body.name is not None
        if self._streamed is None:
            self._streamed = []
            out.append(ToolCallStart(self._index, new_call_id(), body.name))
        if piece := body.take():
            self._streamed.append(piece)
            out.append(ToolCallArgs(self._index, piece))

    def _closing(self, final: bool, out: list[Delta]) -> bool:
        call = self._call
        assert call is not None
        if self.close_marker is None:  # the format has none: the body's end ends the call
            self._pos = call.end
        else:
            p = skip_space(self._buf, self._pos)
            found = expect(self._buf, p, (self.close_marker,), final) if p - self._pos <= GAP_LIMIT else ""
            if found is None:
                return False
            if not found and not self.tolerant:
                self._fall_back("malformed_structure", min(p, self._pos + GAP_LIMIT), out)
                return True
            # without its closing tag (tolerant), what follows the body is scanned afresh
            self._pos = p + len(self.close_marker) if found else call.end
        if self.tolerant:
            out.extend(self._release(call))
            self._buf, self._pos = self._buf[self._pos:], 0
        else:
            self._held.append(call)
        self._mode = _AFTER
        return True

    def _after(self, final: bool, out: list[Delta]) -> bool:
        p = self._pos = skip_space(self._buf, self._pos, len(self._buf))
        found = expect(self._buf, p, (self.open_marker,), final)
        if found is None:
            return False
        if found:
            self.stats.marker_seen = True
            self._body, self._mode = self.new_body(p + len(self.open_marker)), _BODY
            return True
        if p < len(self._buf) and not self.tolerant:
            self._fall_back("trailing_content", p, out)
            return True
        for call in self._held:  # the region ended with nothing but whitespace
            out.extend(self._release(call))
        self._held, self._buf, self._pos, self._mode = [], self._buf[p:], 0, _TEXT
        return True

    def _fall_back(self, reason: str, at: int, out: list[Delta]) -> None:
        """The region up to ``at`` is ordinary text after all."""
        self.stats.fell_back(reason)
        out.append(TextDelta(self._buf[:at]))
        self._buf = self._buf[at:]
        self._held, self._body, self._call, self._pos, self._mode = [], None, None, 0, _TEXT

    def _release(self, call: ParsedCall) -> list[Delta]:
        index, self._index = self._index, self._index + 1
        self.stats.calls += 1
        self.stats.omitted_empty_args += call.omitted
        self.stats.mismatched_args += call.mismatched
        if self._streamed is None:
            start: list[Delta] = [ToolCallStart(index, new_call_id(), call.name)]
            rest = call.arguments
        else:  # the start and a prefix of the arguments are out already
            sent, self._streamed, start = "".join(self._streamed), None, []
            assert call.arguments.startswith(sent), "streamed arguments must prefix the final ones"
            rest = call.arguments[len(sent):]
        return [*start, *([ToolCallArgs(index, rest)] if rest else []), ToolCallEnd(index, call.arguments)]
