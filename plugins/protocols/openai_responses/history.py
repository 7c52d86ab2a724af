"""Canonical Items -> chat turns, the shape every chat template renders.

Contiguous assistant-owned Items (reasoning, assistant messages, function calls) make
one assistant turn, which a chat template can only render as reasoning, then text,
then calls; Items in another order fail rather than being silently rearranged.
Function results answer the calls of the assistant turn just before them: they are
matched by ``call_id`` and put in the calls' order. A turn's calls may go unanswered
altogether, but not in part.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs

from ninfer.errors import InvalidRequestError
from ninfer.frontend.chat_messages import ChatTurn, ToolCall
from ninfer_plugins.protocols.openai_responses.items import Item, item_text
from ninfer_plugins.protocols.openai_responses.tools import model_name

#: where an assistant-owned Item sits inside its turn
_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}


def _assistant_history(message: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=where, code="invalid_assistant_history")


def _tool_history(message: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=where, code="invalid_tool_history")


@attrs.define
class _Group:
    """The assistant turn being collected."""

    stage: int = 0
    reasoning: Optional[list[str]] = None
    text: list[str] = attrs.field(factory=list)
    calls: list[ToolCall] = attrs.field(factory=list)
    identities: dict[str, tuple[str, Optional[str]]] = attrs.field(factory=dict)

    def turn(self) -> ChatTurn:
        reasoning = None if self.reasoning is None else "".join(self.reasoning)
        return ChatTurn("assistant", "".join(self.text), reasoning=reasoning, tool_calls=list(self.calls))


@attrs.define
class _Results:
    """Results given so far for the calls of the last assistant turn."""

    group: _Group
    where: str
    texts: dict[str, str] = attrs.field(factory=dict)


class _Lowering:
    def __init__(self) -> None:
        self.turns: list[ChatTurn] = []
        self.group: Optional[_Group] = None
        self.results: Optional[_Results] = None
        self.call_ids: set[str] = set()

    def add(self, item: Item, where: str) -> None:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            self.close()
            self.turns.append(ChatTurn(item["role"], item_text(item["content"])))
        elif kind == "function_call_output":
            self._result(item, where)
        else:
            self._assistant(item, where)

    def _assistant(self, item: Item, where: str) -> None:
        self._flush_results()
        group = self.group = self.group or _Group()
        stage = _STAGE[item["type"]]
        if stage < group.stage:
            raise _assistant_history(
                f"an assistant turn renders as reasoning, then text, then function calls; this {item['type']} "
                "Item comes after a later part of the same turn", where)
        group.stage = stage
        if item["type"] == "reasoning":
            group.reasoning = (group.reasoning or []) + [item_text(item["content"])]
        elif item["type"] == "message":
            group.text.append(item_text(item["content"]))
        else:
            call_id = item["call_id"]
            if call_id in self.call_ids:
                raise _tool_history(f"call_id {call_id!r} is used by more than one function call", where)
            self.call_ids.add(call_id)
            namespace = item.get("namespace")
            group.calls.append(ToolCall(call_id, model_name(item["name"], namespace), item["arguments"]))
            group.identities[call_id] = (item["name"], namespace)

    def _result(self, item: Item, where: str) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            self.turns.append(group.turn())
            self.results = _Results(group, where) if group.calls else None
        results, call_id = self.results, item["call_id"]
        if results is None or call_id not in results.group.identities:
            raise _tool_history(f"no function call with call_id {call_id!r} directly precedes this result", where)
        if call_id in results.texts:
            raise _tool_history(f"call_id {call_id!r} has more than one result", where)
        name, namespace = results.group.identities[call_id]
        for key, expected in (("name", name), ("namespace", namespace)):
            if key in item and item[key] != expected:
                raise _tool_history(f"the result names {key} {item[key]!r} but call {call_id!r} has {expected!r}",
                                    f"{where}.{key}")
        results.texts[call_id] = item_text(item["output"])

    def _flush_results(self) -> None:
        results, self.results = self.results, None
        if results is None:
            return
        calls = results.group.calls
        if len(results.texts) < len(calls):
            missing = [c.id for c in calls if c.id not in results.texts]
            raise _tool_history(f"results are missing for call_id {', '.join(missing)}; a turn's calls are "
                                "answered all together or not at all", results.where)
        self.turns.extend(ChatTurn("tool", results.texts[c.id], tool_call_id=c.id) for c in calls)

    def close(self) -> None:
        if self.group is not None:
            self.turns.append(self.group.turn())
            self.group = None
        self._flush_results()


def lower_items(items: Sequence[tuple[Item, str]]) -> list[ChatTurn]:
    """Chat turns for ``(item, where)`` pairs; ``where`` names the Item in errors."""
    lowering = _Lowering()
    for item, where in items:
        lowering.add(item, where)
    lowering.close()
    return lowering.turns
