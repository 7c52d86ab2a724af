"""Anthropic system text and message history -> protocol-neutral chat turns.

Consecutive user (or assistant) messages form one turn, their blocks joined with no
separator; system messages inside the history keep their position. A user turn's
leading ``tool_result`` blocks become tool turns in the order of the calls they answer.
A final text-only assistant message is a prefill that generation continues.

Block types fall in three groups: those with a prompt form (text, image, thinking,
tool use and results), those whose meaning needs an executor or storage ninfer lacks
(documents, server-tool blocks, containers...), which are refused by field, and any
other type, which carries nothing for the prompt (say ``tool_reference``) and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import ChatTurn, ToolCall

#: a leading system block starting so is Claude Code's attribution line, not prompt text
BILLING_PREFIX = "x-anthropic-billing-header:"
#: how an ``is_error`` tool result is marked in the prompt
TOOL_ERROR_PREFIX = "Error: "
_REFUSED = {
    "document": "documents",
    "search_result": "search results",
    "container_upload": "container uploads",
    "redacted_thinking": "encrypted (redacted) thinking",
    "browser_state": "browser state",
}
_MEDIA = ("image",)


def _refusal(kind: str) -> str | None:
    """What a block type needs that ninfer lacks; None for types with a prompt form or none at all."""
    if kind in _REFUSED:
        return _REFUSED[kind]
    if kind not in ("tool_use", "tool_result") and (kind.endswith("_tool_use") or kind.endswith("_tool_result")):
        return "server-tool and MCP blocks"
    return None


@dataclass
class Lowered:
    turns: list[ChatTurn]
    #: the last turn is an assistant prefill that generation continues
    prefill: bool = False
    #: message index -> turns lowered up to and including its group (for cache breakpoints)
    message_turns: dict[int, int] = field(default_factory=dict)


@dataclass
class _Group:
    """Consecutive messages of one role: ``blocks`` pairs each block with its field path."""

    role: str
    where: str
    blocks: list[tuple[Any, str]] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # the messages it holds


def consume_billing(system: Any) -> tuple[Any, int]:
    """``system`` without a leading attribution block, and how many blocks were dropped (0 or 1).

    Only the first block of the array form counts; its cache marker goes with it.
    """
    if isinstance(system, list) and system and isinstance(system[0], Mapping):
        first = system[0]
        text = first.get("text")
        if first.get("type") == "text" and isinstance(text, str) and text.startswith(BILLING_PREFIX):
            return system[1:], 1
    return system, 0


def system_text(system: Any, where: str = "system", start: int = 0) -> str:
    """A string, or text blocks joined as they are (``start``: index of the first block)."""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise InvalidRequestError("system must be a string or an array of text blocks", param=where)
    parts = []
    for j, block in enumerate(system, start):
        path = f"{where}[{j}]"
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise InvalidRequestError("system blocks must be text blocks", param=f"{path}.type")
        parts.append(_text(block, path))
    return "".join(parts)


def _text(block: Mapping[str, Any], path: str, key: str = "text") -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"a {block.get('type')} block needs a string {key}", param=f"{path}.{key}")
    return value


def _groups(messages: Any) -> list[_Group]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty array", param="messages")
    groups: list[_Group] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError("each message must be an object", param=where)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise InvalidRequestError("role must be user, assistant or system", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            blocks = [({"type": "text", "text": content}, f"{where}.content")]
        elif isinstance(content, list):
            blocks = [(b, f"{where}.content[{j}]") for j, b in enumerate(content)]
        else:
            raise InvalidRequestError("content must be a string or an array of blocks", param=f"{where}.content")
        for block, path in blocks:
            if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
                raise InvalidRequestError("each content block must be an object with a type", param=path)
        if groups and role != "system" and groups[-1].role == role:
            groups[-1].blocks += blocks
            groups[-1].indices.append(i)
        else:
            groups.append(_Group(role, where, blocks, [i]))
    return groups


def lower_messages(messages: Any) -> Lowered:
    """Validate the history and turn it into chat turns (see the module docstring)."""
    groups = _groups(messages)
    turns: list[ChatTurn] = []
    pending: list[str] | None = None  # call ids of the last assistant turn, awaiting results
    seen_assistant = False
    message_turns: dict[int, int] = {}
    for n, group in enumerate(groups):
        if pending and group.role != "user":
            raise InvalidRequestError("tool_use blocks must be answered by tool_result blocks in the next user "
                                      "message", param=group.where)
        if group.role == "system":
            turns.append(ChatTurn("system", _joined(group, "system")))
        elif group.role == "user":
            turns += _user(group, pending, seen_assistant)
            pending = None
        else:
            turn = _assistant(group)
            seen_assistant = True
            pending = [c.id for c in turn.tool_calls]
            turns.append(turn)
        for index in group.indices:
            message_turns[index] = len(turns)
    last = groups[-1]
    if last.role != "assistant":
        return Lowered(turns, message_turns=message_turns)
    final = turns[-1]
    if final.tool_calls or final.reasoning is not None:
        raise InvalidRequestError("a final assistant message is a prefill and may hold only text (no thinking "
                                  "or tool_use blocks)", param=last.where)
    return Lowered(turns, prefill=True, message_turns=message_turns)


def _joined(group: _Group, role: str) -> str:
    parts = []
    for block, path in group.blocks:
        text = _content_text(block, path, role)
        if text is not None:
            parts.append(text)
    return "".join(parts)


def _content_text(block: Mapping[str, Any], path: str, role: str) -> str | None:
    """Text of a text block; None for a skipped block; raises for refused or misplaced ones."""
    kind = block["type"]
    if kind == "text":
        return _text(block, path)
    if kind in _MEDIA and role in ("user", "tool_result"):
        _check_media(block, path)
    refused = _refusal(kind)
    if refused is not None:
        raise UnsupportedFeatureError(f"{refused} are not supported (block type {kind!r})", param=f"{path}.type")
    if kind in ("image", "thinking", "tool_use", "tool_result"):
        raise InvalidRequestError(f"{kind} blocks are not allowed in {role} content", param=f"{path}.type")
    return None


def _check_media(block: Mapping[str, Any], path: str) -> None:
    """Well-formed or not, an image is refused until a vision tower exists."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "base64":
        if not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
            raise InvalidRequestError("a base64 image needs media_type and data", param=f"{path}.source")
    elif kind == "url":
        if not isinstance(source.get("url"), str) or not source["url"]:
            raise InvalidRequestError("a url image needs a url", param=f"{path}.source.url")
    elif kind == "file":
        raise UnsupportedFeatureError("file references are not supported (there is no file store)",
                                      param=f"{path}.source")
    else:
        raise InvalidRequestError("image source type must be base64 or url", param=f"{path}.source.type")
    raise InvalidRequestError("image input needs a server started with vision enabled (--vision)",
                              param=path, code="vision_disabled")


def _user(group: _Group, pending: list[str] | None, seen_assistant: bool) -> list[ChatTurn]:
    lead = 0
    while lead < len(group.blocks) and group.blocks[lead][0]["type"] == "tool_result":
        lead += 1
    results = [_tool_result(block, path) for block, path in group.blocks[:lead]]
    for block, path in group.blocks[lead:]:
        if block["type"] == "tool_result":
            raise InvalidRequestError("tool_result blocks must come first in a user message", param=path)
    turns = _ordered_results(results, pending, seen_assistant, group.where)
    if lead < len(group.blocks) or not results:
        rest = _Group("user", group.where, group.blocks[lead:])
        turns.append(ChatTurn("user", _joined(rest, "user")))
    return turns


def _tool_result(block: Mapping[str, Any], path: str) -> tuple[str, str, ChatTurn]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError("a tool_result needs a tool_use_id", param=f"{path}.tool_use_id")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise InvalidRequestError("is_error must be a boolean", param=f"{path}.is_error")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, inner in enumerate(content):
            where = f"{path}.content[{j}]"
            if not isinstance(inner, Mapping) or not isinstance(inner.get("type"), str):
                raise InvalidRequestError("each content block must be an object with a type", param=where)
            text = _content_text(inner, where, "tool_result")
            if text is not None:
                parts.append(text)
        text = "".join(parts)
    else:
        raise InvalidRequestError("tool_result content must be a string or an array of blocks",
                                  param=f"{path}.content")
    if is_error:
        text = TOOL_ERROR_PREFIX + text
    return call_id, path, ChatTurn("tool", text, tool_call_id=call_id)


def _ordered_results(results: list[tuple[str, str, ChatTurn]], pending: list[str] | None, seen_assistant: bool,
                     where: str) -> list[ChatTurn]:
    """Results in call order; each call of the previous turn needs exactly one."""
    if not pending:
        if results and seen_assistant:
            raise InvalidRequestError("tool_result blocks must answer tool_use blocks of the previous assistant "
                                      "message", param=results[0][1])
        return [turn for _, _, turn in results]  # a history that starts with results: kept as given
    by_id: dict[str, ChatTurn] = {}
    for call_id, path, turn in results:
        if call_id not in pending:
            raise InvalidRequestError(f"no tool_use with id {call_id!r} in the previous assistant message",
                                      param=f"{path}.tool_use_id")
        if call_id in by_id:
            raise InvalidRequestError(f"tool_use {call_id!r} has more than one tool_result",
                                      param=f"{path}.tool_use_id")
        by_id[call_id] = turn
    missing = [c for c in pending if c not in by_id]
    if missing:
        raise InvalidRequestError(f"tool_use ids without a tool_result: {', '.join(missing)}; each call needs "
                                  "one at the start of the next user message", param=f"{where}.content")
    return [by_id[c] for c in pending]


def _assistant(group: _Group) -> ChatTurn:
    text: list[str] = []
    reasoning: list[str] | None = None
    calls: list[ToolCall] = []
    for block, path in group.blocks:
        kind = block["type"]
        if kind == "thinking":
            # the signature is transport metadata: the visible text alone rebuilds the prompt
            reasoning = (reasoning or []) + [_text(block, path, "thinking")]
        elif kind == "tool_use":
            calls.append(_tool_use(block, path, {c.id for c in calls}))
        else:
            piece = _content_text(block, path, "assistant")
            if piece is not None:
                text.append(piece)
    return ChatTurn("assistant", "".join(text), reasoning="".join(reasoning) if reasoning is not None else None,
                    tool_calls=calls)


def _tool_use(block: Mapping[str, Any], path: str, ids: set[str]) -> ToolCall:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError("a tool_use needs an id", param=f"{path}.id")
    if call_id in ids:
        raise InvalidRequestError(f"tool_use id {call_id!r} is used twice", param=f"{path}.id")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a tool_use needs a name", param=f"{path}.name")
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError("a tool_use input must be an object", param=f"{path}.input")
    return ToolCall(call_id, name, dict(arguments))
