"""Splits generated text into reasoning, answer text and structured tool calls.

Protocol adapters feed each engine event's text here and render the deltas that come
back; streaming and aggregate responses use the same splitter, so concatenated stream
deltas always equal the aggregate result. Nothing here knows a wire format.

The reasoning markers are the :class:`ReasoningParser` plugin's. The layout around them
is trimmed the same way for every format: one newline inside each side of the reasoning
and the newlines that open the answer are formatting, not content (Qwen renders
``<think>\\n REASONING \\n</think>\\n\\n ANSWER``, DeepSeek-R1 likewise), and a format
without them loses nothing, since only newlines next to a marker are dropped. Tool calls
are looked for in the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from ninfer.capabilities import ReasoningParser


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Ordinary answer text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order calls appear in one response
    id: str  # "call_" + random hex, unique
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    """A piece of the arguments JSON; a call's pieces concatenate to its final arguments."""

    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    arguments: str  # the complete arguments JSON object


Delta = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArgs, ToolCallEnd]


@dataclass
class ToolCallParseStats:
    """Per-request parse diagnostics for the request log; never holds generated text."""

    marker_seen: bool = False  # a complete opening marker appeared in the answer
    calls: int = 0  # structured calls returned
    omitted_empty_args: int = 0  # empty blocks of non-string parameters dropped
    mismatched_args: int = 0  # arguments kept although not of a declared type
    #: first reason markup went back to text: none, malformed_structure, duplicate_parameter,
    #: invalid_tool_name, undeclared_tool or trailing_content; or truncated_call when a
    #: call already streaming (tolerant mode) broke off and was closed early (it still counts
    #: in ``calls``; the raw text after what its arguments stand for went out as text)
    fallback_reason: str = "none"

    def fell_back(self, reason: str) -> None:
        if self.fallback_reason == "none":
            self.fallback_reason = reason

    def as_dict(self) -> dict[str, object]:
        return {
            "marker_seen": self.marker_seen,
            "calls": self.calls,
            "omitted_empty_args": self.omitted_empty_args,
            "mismatched_args": self.mismatched_args,
            "fallback_reason": self.fallback_reason,
        }


class ToolCallParser(Protocol):
    """What a ``ToolParser`` plugin's ``factory(tools, tolerant=False)`` returns."""

    stats: ToolCallParseStats

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


def coalesce(deltas: list[Delta]) -> list[Delta]:
    """Merge neighbouring text (or reasoning) deltas and drop empty ones."""
    out: list[Delta] = []
    for d in deltas:
        if isinstance(d, (TextDelta, ReasoningDelta)):
            if not d.text:
                continue
            if out and type(out[-1]) is type(d):
                out[-1] = type(d)(out[-1].text + d.text)  # type: ignore[union-attr]
                continue
        out.append(d)
    return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_OPENING, _THINK_LEAD, _THINK, _AFTER_THINK, _ANSWER = range(5)


class OutputSplitter:
    """Per-request splitter of generated text into typed deltas.

    ``starts_in_reasoning`` is set when the prompt already opened the reasoning channel
    (some templates, Qwen's among them, end the prompt with the opening marker when
    thinking is on); otherwise a
    reasoning marker is recognised only at the very start of the output.
    """

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tool_parser: ToolCallParser | None,
        starts_in_reasoning: bool = False,
    ):
        if starts_in_reasoning and reasoning is None:
            raise ValueError("starts_in_reasoning needs a reasoning parser")
        self._reasoning = reasoning
        self._tools = tool_parser
        self._state = _THINK_LEAD if starts_in_reasoning else _OPENING if reasoning else _ANSWER
        self._buf = ""
        #: output tokens fed while the reasoning channel was open (markers included)
        self.reasoning_tokens = 0

    @property
    def tool_call_parse(self) -> dict[str, object]:
        stats = self._tools.stats if self._tools is not None else ToolCallParseStats()
        return stats.as_dict()

    def _in_reasoning(self) -> bool:
        return self._state in (_THINK_LEAD, _THINK)

    def feed(self, text: str, num_tokens: int = 1) -> list[Delta]:
        """Split the text of ``num_tokens`` newly generated tokens."""
        before = self._in_reasoning()
        self._buf += text
        out = self._advance(final=False)
        if before or self._in_reasoning():
            self.reasoning_tokens += num_tokens
        return coalesce(out)

    def finish(self) -> list[Delta]:
        """Release everything held back; the output has ended."""
        out = self._advance(final=True)
        if self._tools is not None:
            out += self._tools.finish()
        return coalesce(out)

    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._step(final, out):
            pass
        return out

    def _step(self, final: bool, out: list[Delta]) -> bool:
        """Consume what can be decided in the current state; False when nothing could."""
        buf, state = self._buf, self._state
        if state == _ANSWER:
            if buf:
                self._buf = ""
                out.extend(self._tools.feed(buf) if self._tools is not None else [TextDelta(buf)])
            return False
        assert self._reasoning is not None
        start, end = self._reasoning.start, self._reasoning.end
        if state == _OPENING:
            if buf.startswith(start):
                self._buf, self._state = buf[len(start):], _THINK_LEAD
            elif start.startswith(buf) and not final:
                return False
            else:
                self._state = _ANSWER
            return True
        if state == _THINK_LEAD:
            if not buf:
                return False
            if buf[0] == "\n":
                self._buf = buf[1:]
            self._state = _THINK
            return True
        if state == _THINK:
            i = buf.find(end)
            if i >= 0:
                text = buf[:i]
                out.append(ReasoningDelta(text[:-1] if text.endswith("\n") else text))
                self._buf, self._state = buf[i + len(end):], _AFTER_THINK
                return True
            keep = 0 if final else partial_suffix(buf, end)
            if keep < len(buf) and buf[len(buf) - keep - 1] == "\n" and not final:
                keep += 1  # the newline that may precede the closing marker
            out.append(ReasoningDelta(buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep:]
            return False
        # _AFTER_THINK: the newlines that open the answer are not content
        rest = buf.lstrip("\n")
        self._buf = rest
        if not rest:
            return False
        self._state = _ANSWER
        return True
