"""Protocol-neutral conversation history: OpenAI-shaped messages in, chat-template messages out.

Every front door (Chat Completions, Responses, Anthropic Messages) lowers its history to
OpenAI-chat-shaped dicts and hands them to :func:`parse_messages`; the result renders
through :func:`template_messages`. Errors name the offending field as a path under
``param`` (``messages[2].content[0].type``) so clients can find it.

Content parts are concatenated with no separator, so a client that split one text into
parts renders exactly the same prompt. Tool-call arguments keep the member order they
arrived with: an unmodified replay of a generated call renders the same bytes.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import attrs

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError, type_field
from ninfer.frontend.tool_schema import JSONTooDeepError, LoneSurrogateError, loads_json

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: content-part types carrying media, which need the vision tower
_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
_UNSUPPORTED_PARTS = {"input_audio": "audio input", "file": "file input"}


@attrs.define
class ToolCall:
    """One call of an assistant turn; ``arguments`` is JSON text or an already-decoded object."""

    id: str
    name: str
    arguments: str | dict[str, Any]


@attrs.define
class ChatTurn:
    """One normalised message. ``role`` is system, developer, user, assistant or tool."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    tool_call_id: str | None = None


def parse_messages(messages: Any, param: str = "messages") -> list[ChatTurn]:
    """Validate and normalise a message list (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"{param} must be a non-empty array of messages", param=param)
    return [_parse_message(m, f"{param}[{i}]") for i, m in enumerate(messages)]


def _parse_message(message: Any, where: str) -> ChatTurn:
    if not isinstance(message, Mapping):
        raise InvalidRequestError("each message must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"role must be one of {', '.join(ROLES)}", param=f"{where}.role")
    _check_name(message, role, where)
    if role == "assistant":
        return _assistant(message, where)
    text = content_text(message.get("content"), f"{where}.content", role)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError("tool_call_id must be a string", param=f"{where}.tool_call_id")
        return ChatTurn("tool", text, tool_call_id=call_id)
    if role == "function":  # legacy function result: a tool result without a call id
        return ChatTurn("tool", text)
    return ChatTurn(role, text)


def _check_name(message: Mapping[str, Any], role: str, where: str) -> None:
    """Tool/function results may carry the function's name (ignored: it has no prompt form);
    a participant name on any other role cannot be represented."""
    name = message.get("name")
    if name is None:
        if role == "function":
            raise InvalidRequestError("a function message needs the function's name", param=f"{where}.name")
        return
    if not isinstance(name, str):
        raise InvalidRequestError("name must be a string", param=f"{where}.name")
    if name and role not in ("tool", "function"):
        raise UnsupportedFeatureError(
            f"participant names on {role} messages are not supported: the chat template cannot represent them",
            param=f"{where}.name",
        )


def _assistant(message: Mapping[str, Any], where: str) -> ChatTurn:
    content = message.get("content")
    text = "" if content is None else content_text(content, f"{where}.content", "assistant")
    reasoning = _reasoning(message, where)
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    if calls and legacy:
        raise InvalidRequestError("give either tool_calls or the legacy function_call", param=f"{where}.function_call")
    tool_calls: list[ToolCall] = []
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidRequestError("tool_calls must be an array", param=f"{where}.tool_calls")
        for j, call in enumerate(calls):
            tool_calls.append(_tool_call(call, f"{where}.tool_calls[{j}]"))
    if legacy is not None:
        tool_calls.append(_function(legacy, "", f"{where}.function_call"))
    return ChatTurn("assistant", text, reasoning=reasoning, tool_calls=tool_calls)


def _reasoning(message: Mapping[str, Any], where: str) -> str | None:
    """``reasoning_content`` and its alias ``reasoning``; both given must agree."""
    given = {k: message[k] for k in ("reasoning_content", "reasoning") if message.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise InvalidRequestError(f"{key} must be a string", param=f"{where}.{key}")
    if len(set(given.values())) > 1:
        raise InvalidRequestError("reasoning_content and reasoning disagree", param=f"{where}.reasoning")
    return next(iter(given.values()), None)


def _tool_call(call: Any, where: str) -> ToolCall:
    if not isinstance(call, Mapping):
        raise InvalidRequestError("a tool call must be an object", param=where)
    if call.get("type", "function") != "function":
        raise UnsupportedFeatureError("only function tool calls are supported", param=f"{where}.type")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise InvalidRequestError("a tool call id must be a string", param=f"{where}.id")
    return _function(call.get("function"), call_id, f"{where}.function")


def _function(fn: Any, call_id: str, where: str) -> ToolCall:
    if not isinstance(fn, Mapping):
        raise InvalidRequestError("function must be an object with name and arguments", param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a function name must be a non-empty string", param=f"{where}.name")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, (str, Mapping)):
        raise InvalidRequestError("arguments must be a JSON string or an object", param=f"{where}.arguments")
    if isinstance(arguments, str):
        _check_arguments(arguments, f"{where}.arguments")
    return ToolCall(call_id, name, arguments if isinstance(arguments, str) else dict(arguments))


def _check_arguments(text: str, where: str) -> None:
    """Argument text that is not JSON renders as given, but JSON that is too deep to decode
    or decodes to a lone surrogate (which no tokenizer can encode) is refused."""
    try:
        loads_json(text)
    except (JSONTooDeepError, LoneSurrogateError) as exc:
        raise InvalidRequestError(f"arguments: {exc}", param=where) from None
    except ValueError:
        pass


def content_text(content: Any, where: str, role: str) -> str:
    """Message content as one string: text (and, for assistants, refusal) parts joined as-is."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or an array of content parts", param=where)
    return "".join(_part_text(part, f"{where}[{j}]", role) for j, part in enumerate(content))


def _part_text(part: Any, where: str, role: str) -> str:
    if not isinstance(part, Mapping):
        raise InvalidRequestError("a content part must be an object", param=where)
    kind = type_field(part, where)
    if kind == "text" or (kind == "refusal" and role == "assistant"):
        text = part.get(kind)
        if not isinstance(text, str):
            raise InvalidRequestError(f"a {kind} part needs a string {kind}", param=f"{where}.{kind}")
        return text
    if kind in _MEDIA_PARTS and role in ("user", "tool"):
        _media(part, kind, where)
    if kind in _UNSUPPORTED_PARTS:
        raise UnsupportedFeatureError(f"{_UNSUPPORTED_PARTS[kind]} is not supported", param=f"{where}.type")
    raise InvalidRequestError(f"content part type {kind!r} is not allowed in a {role} message", param=f"{where}.type")


def _media(part: Mapping[str, Any], kind: str, where: str) -> None:
    """Media parts are well-formed or not, but never accepted until a vision tower exists."""
    source = part.get(kind)
    url = source.get("url") if isinstance(source, Mapping) else source
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{kind} needs a url", param=f"{where}.{kind}")
    detail = source.get("detail") if isinstance(source, Mapping) else None
    if detail not in (None, "auto"):
        raise UnsupportedFeatureError(
            "explicit image detail is not supported (omit it or use auto)", param=f"{where}.{kind}.detail"
        )
    raise InvalidRequestError(
        f"{_MEDIA_PARTS[kind]} input needs a server started with vision enabled", param=where, code="vision_disabled"
    )


# -- rendering ------------------------------------------------------------------------


def template_role(role: str) -> str:
    """The role a chat template sees: developer turns are system turns (Qwen-family
    templates know only system)."""
    return "system" if role == "developer" else role


def template_messages(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    """Messages as chat templates read them.

    Roles as :func:`template_role` maps them. JSON-object argument strings are decoded,
    keeping member order, because some templates iterate the arguments rather than print
    them.
    """
    out: list[dict[str, Any]] = []
    for turn in turns:
        role = template_role(turn.role)
        message: dict[str, Any] = {"role": role, "content": turn.content}
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in turn.tool_calls
            ]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        out.append(message)
    return out


def _arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        decoded = json.loads(arguments)
    except (ValueError, RecursionError):  # too deep was refused by _check_arguments
        return arguments
    return decoded if isinstance(decoded, dict) else arguments
