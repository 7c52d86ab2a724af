"""The pipeline's choice events -> Anthropic content blocks, stop reason and usage.

:class:`MessageState` turns each event into block events (start, delta, stop). A
stream sends them as they come; the aggregate response is the blocks they built, so a
concatenated stream always equals the aggregate. A block opens when the kind of
output changes (thinking, text, a tool call) and closes before the next one opens or
when the output ends; a thinking block gets its signature just before it closes.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ninfer.frontend.choice_output import ChoiceEvent, ChoiceProgress
from ninfer.frontend.output_split import (
    Delta,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer_plugins.protocols.anthropic_messages.schema import Message, Usage

_SIGNATURE_TAG = b"ninfer-thinking-v1\0"


def signature(thinking: str) -> str:
    """An opaque token for a thinking block; ninfer never checks one it gets back."""
    return base64.b64encode(hashlib.sha256(_SIGNATURE_TAG + thinking.encode()).digest()).decode()


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for the splitter's unique call ids."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass(frozen=True)
class BlockStart:
    index: int
    block: dict[str, Any]


@dataclass(frozen=True)
class BlockDelta:
    index: int
    delta: dict[str, Any]


@dataclass(frozen=True)
class BlockStop:
    index: int


BlockEvent = Union[BlockStart, BlockDelta, BlockStop]


class BlockBuilder:
    """Splitter deltas -> block events, keeping the finished blocks for the aggregate."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: Optional[str] = None  # type of the open block
        self.called_tools = False

    def _start(self, block: dict[str, Any]) -> list[BlockEvent]:
        out = self.close()
        self.blocks.append(block)
        self._open = block["type"]
        snapshot = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return out + [BlockStart(len(self.blocks) - 1, snapshot)]

    def close(self) -> list[BlockEvent]:
        """Close the open block, if any (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        out: list[BlockEvent] = []
        if self._open == "thinking":
            block["signature"] = signature(block["thinking"])
            out.append(BlockDelta(index, {"type": "signature_delta", "signature": block["signature"]}))
        self._open = None
        return out + [BlockStop(index)]

    def feed(self, deltas: Sequence[Delta]) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if self._open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.blocks[-1]["thinking"] += d.text
                out.append(BlockDelta(len(self.blocks) - 1, {"type": "thinking_delta", "thinking": d.text}))
            elif isinstance(d, TextDelta):
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                self.blocks[-1]["text"] += d.text
                out.append(BlockDelta(len(self.blocks) - 1, {"type": "text_delta", "text": d.text}))
            elif isinstance(d, ToolCallStart):
                self.called_tools = True
                out += self._start({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            elif isinstance(d, ToolCallArgs):
                out.append(BlockDelta(len(self.blocks) - 1, {"type": "input_json_delta", "partial_json": d.fragment}))
            elif isinstance(d, ToolCallEnd):
                self.blocks[-1]["input"] = json.loads(d.arguments)  # member order as generated
                out += self.close()
        return out


class MessageState:
    """One response: its blocks, and (from the pipeline's choice) token counts and how it ended.

    ``max_tokens`` is the output budget the engine applied, which tells a ``length``
    finish at that budget from one at the context's end.
    """

    def __init__(self, choice: ChoiceProgress, max_tokens: int):
        self.choice = choice
        self.max_tokens = max_tokens
        self.builder = BlockBuilder()

    def feed(self, event: ChoiceEvent) -> list[BlockEvent]:
        out = self.builder.feed(event.deltas)
        if event.finished:
            out += self.builder.close()
        return out

    def usage(self) -> Usage:
        c = self.choice
        return Usage(input_tokens=c.prompt_tokens - c.cached_tokens, output_tokens=c.completion_tokens,
                     cache_read_input_tokens=c.cached_tokens)

    def stop(self) -> tuple[Optional[str], Optional[str]]:
        """``(stop_reason, stop_sequence)``; None before the end."""
        finish, matched = self.choice.finish_reason, self.choice.stop_reason
        if finish == "length":
            at_budget = self.choice.completion_tokens >= self.max_tokens
            return ("max_tokens" if at_budget else "model_context_window_exceeded"), None
        if finish is None:
            return None, None
        if isinstance(matched, str):
            return "stop_sequence", matched
        return ("tool_use" if self.builder.called_tools else "end_turn"), None

    def message(self, message_id: str, model: str) -> Message:
        reason, sequence = self.stop()
        return Message(id=message_id, model=model, content=self.builder.blocks, stop_reason=reason,
                       stop_sequence=sequence, usage=self.usage())
