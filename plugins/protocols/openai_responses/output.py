"""Splitter deltas -> output Items and the semantic events that build them.

Streaming and aggregate answers run the same assembler (the aggregate simply drops the
events), so concatenated deltas equal the final Items by construction. Events are
returned without ``sequence_number``; :mod:`.stream` numbers them. Item ids and
output indices are fixed when an Item is added and never change.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

from ninfer.frontend.output_split import Delta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from ninfer_plugins.protocols.openai_responses.items import Item, new_id
from ninfer_plugins.protocols.openai_responses.sealed import seal
from ninfer_plugins.protocols.openai_responses.tools import ToolIdentity

Event = dict[str, Any]


def _text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputAssembler:
    def __init__(self, identities: dict[str, ToolIdentity], seal_reasoning: bool):
        self.identities = identities
        self.seal_reasoning = seal_reasoning
        self.items: list[Item] = []
        self._open: Optional[Item] = None  # the reasoning or message Item receiving text
        self._pieces: list[str] = []
        self._calls: dict[int, int] = {}  # splitter call index -> output index

    def feed(self, deltas: Sequence[Delta]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if isinstance(d, (ReasoningDelta, TextDelta)):
                events += self._text("reasoning" if isinstance(d, ReasoningDelta) else "message", d.text)
            elif isinstance(d, ToolCallStart):
                events += self._close("completed")
                events += self._call_start(d)
            elif isinstance(d, ToolCallArgs):
                events += self._call_args(d)
            elif isinstance(d, ToolCallEnd):
                events += self._call_end(d)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open Item with the Response's ``status`` (completed or incomplete).

        A completed turn that produced nothing still answers with an (empty) message;
        an incomplete one does not invent it.
        """
        events = self._close(status)
        if not self.items and status == "completed":
            events += self._open_item("message")
            events += self._close(status)
        return events

    def snapshot(self) -> list[Item]:
        """Items so far, the open one marked incomplete (for a failed Response)."""
        items = copy.deepcopy(self.items)
        if self._open is not None:
            index = self.items.index(self._open)
            items[index] = self._final(copy.deepcopy(self._open), "".join(self._pieces), "incomplete")
        return items

    # -- text Items ----------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        self._pieces.append(text)
        event = {"type": "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                 "item_id": item["id"], "output_index": self.items.index(item), "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return [*events, event]

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: Item = {"id": new_id("reasoning"), "type": "reasoning", "summary": [], "content": [],
                          "status": "in_progress"}
        else:
            item = {"id": new_id("message"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
        self.items.append(item)
        self._open, self._pieces = item, []
        index = len(self.items) - 1
        return [
            {"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)},
            {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
             "content_index": 0, "part": _text_part(kind, "")},
        ]

    def _final(self, item: Item, text: str, status: str) -> Item:
        item["content"] = [_text_part(item["type"], text)]
        if item["type"] == "reasoning" and self.seal_reasoning:
            item["encrypted_content"] = seal(text)
        item["status"] = status
        return item

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._pieces)
        self._final(item, text, status)
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = {"type": "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done",
                **where, "text": text}
        if item["type"] == "message":
            done["logprobs"] = []
        return [
            done,
            {"type": "response.content_part.done", **where, "part": copy.deepcopy(item["content"][0])},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    # -- function calls ------------------------------------------------------------
    def _call_start(self, d: ToolCallStart) -> list[Event]:
        identity = self.identities.get(d.name, ToolIdentity(d.name))
        item: Item = {"id": new_id("function_call"), "type": "function_call", "call_id": d.id,
                      "name": identity.name}
        if identity.namespace is not None:
            item["namespace"] = identity.namespace
        item.update(arguments="", status="in_progress")
        self.items.append(item)
        self._calls[d.index] = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _call_args(self, d: ToolCallArgs) -> list[Event]:
        index = self._calls[d.index]
        item = self.items[index]
        item["arguments"] += d.fragment
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": d.fragment}]

    def _call_end(self, d: ToolCallEnd) -> list[Event]:
        index = self._calls[d.index]
        item = self.items[index]
        item.update(arguments=d.arguments, status="completed")
        return [
            {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
             "name": item["name"], "arguments": d.arguments},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]
