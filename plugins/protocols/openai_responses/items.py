"""Input Items -> canonical Items: checked, with ids, in client order.

Canonical Items are what ``input_items`` lists, what a stored Response keeps as its
conversation, and what :mod:`.history` lowers to chat turns. They keep the client's
text exactly; string content becomes one text part, a reasoning Item always holds its
raw ``reasoning_text`` (restored from ``encrypted_content`` when that was all the
client sent), and every Item gets an id when it has none.
"""

from __future__ import annotations

import secrets
from typing import Any, Mapping, Optional

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError, type_field
from ninfer.frontend.tool_schema import JSONTooDeepError, LoneSurrogateError, loads_json
from ninfer.frontend.openai_cache_hints import check_breakpoint
from ninfer_plugins.protocols.openai_responses.sealed import unseal

Item = dict[str, Any]
ROLES = ("user", "assistant", "system", "developer")
ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}
_MEDIA = {"input_image": ("image_url", "image"), "input_video": ("video_url", "video")}
_UNSUPPORTED_PARTS = {"input_file": "file input", "input_audio": "audio input"}


def new_id(kind: str) -> str:
    return f"{ID_PREFIX[kind]}_{secrets.token_hex(16)}"


def canonical_input(raw: Any, *, has_parent: bool, unique_ids: bool) -> list[Item]:
    """The request's ``input`` as canonical Items.

    A missing or empty input starts no turn when a previous Response supplies the
    conversation; without one it becomes a single empty user message, so a bare probe
    still renders a well-formed prompt. ``unique_ids`` rejects repeated Item ids (a
    stored Response lists its Items by id, so ids must identify them).
    """
    if raw is None or raw == []:
        raw = None if has_parent else ""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "id": new_id("message"), "role": "user",
                 "content": [{"type": "input_text", "text": raw}], "status": "completed"}]
    items = [_item(entry, f"input[{i}]") for i, entry in enumerate(raw)]
    if unique_ids:
        seen: dict[str, int] = {}
        for i, item in enumerate(items):
            first = seen.setdefault(item["id"], i)
            if first != i:
                raise InvalidRequestError(f"input[{i}] repeats the id of input[{first}]", param=f"input[{i}].id")
    return items


def _item(entry: Any, where: str) -> Item:
    if not isinstance(entry, Mapping):
        raise InvalidRequestError("an input Item must be an object", param=where)
    kind = type_field(entry, where, "message" if "role" in entry else None)
    if kind not in ID_PREFIX:
        raise UnsupportedFeatureError(f"input Items of type {kind!r} are not supported", param=f"{where}.type")
    item_id = entry.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not item_id):
        raise InvalidRequestError("an Item id must be a non-empty string", param=f"{where}.id")
    item = {"message": _message, "reasoning": _reasoning, "function_call": _call,
            "function_call_output": _output}[kind](entry, where)
    return {"type": kind, "id": item_id or new_id(kind), **item}


def _string(entry: Mapping[str, Any], key: str, where: str, required: bool = True) -> Optional[str]:
    value = entry.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise InvalidRequestError(f"{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _status(entry: Mapping[str, Any], where: str, tool: bool) -> str:
    status = entry.get("status")
    if status is None:
        return "completed"
    if not isinstance(status, str):
        raise InvalidRequestError("status must be a string", param=f"{where}.status")
    if tool and status != "completed":
        raise UnsupportedFeatureError("only completed tool Items can be replayed", param=f"{where}.status")
    return status


def _message(entry: Mapping[str, Any], where: str) -> Item:
    role = entry.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"role must be one of {', '.join(ROLES)}", param=f"{where}.role")
    content = entry.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]
    else:
        raise InvalidRequestError("content must be a string or an array of parts", param=f"{where}.content")
    phase = entry.get("phase")
    if phase is not None and not isinstance(phase, str):
        raise InvalidRequestError("phase must be a string", param=f"{where}.phase")
    item: Item = {"role": role, "content": parts, "status": _status(entry, where, tool=False)}
    if phase is not None:
        item["phase"] = phase
    return item


def _part(part: Any, where: str, role: str) -> Item:
    if not isinstance(part, Mapping):
        raise InvalidRequestError("a content part must be an object", param=where)
    kind = type_field(part, where)
    if kind == "input_text" or (kind in ("output_text", "refusal") and role == "assistant"):
        key = "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            raise InvalidRequestError(f"a {kind} part needs a string {key}", param=f"{where}.{key}")
        check_breakpoint(part.get("prompt_cache_breakpoint"), where)  # prepare.explicit_breakpoints places it
        return {"type": kind, key: text}
    if kind in _MEDIA and role in ("user", "assistant", "tool"):
        _media(part, kind, where)
    if kind in _UNSUPPORTED_PARTS:
        raise UnsupportedFeatureError(f"{_UNSUPPORTED_PARTS[kind]} is not supported", param=f"{where}.type")
    raise InvalidRequestError(f"content part type {kind!r} is not allowed here", param=f"{where}.type")


def _media(part: Mapping[str, Any], kind: str, where: str) -> None:
    """Well-formed media still needs a vision tower, which this server does not load."""
    key, what = _MEDIA[kind]
    if part.get("file_id") is not None:
        raise UnsupportedFeatureError("media by file_id is not supported; give a URL", param=f"{where}.file_id")
    url = part.get(key)
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{kind} needs a {key}", param=f"{where}.{key}")
    if part.get("detail") not in (None, "auto"):
        raise UnsupportedFeatureError("explicit image detail is not supported (omit it or use auto)",
                                      param=f"{where}.detail")
    check_breakpoint(part.get("prompt_cache_breakpoint"), where)  # prepare.explicit_breakpoints places it
    raise InvalidRequestError(f"{what} input needs a server started with vision enabled", param=where,
                              code="vision_disabled")


def _reasoning(entry: Mapping[str, Any], where: str) -> Item:
    content = entry.get("content") or []
    if not isinstance(content, list):
        raise InvalidRequestError("content must be an array of reasoning_text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "reasoning_text"
                and isinstance(part.get("text"), str)):
            raise InvalidRequestError("reasoning content parts must be reasoning_text with a string text",
                                      param=f"{where}.content[{j}]")
        texts.append(part["text"])
    summary = entry.get("summary") or []
    if not isinstance(summary, list):
        raise InvalidRequestError("summary must be an array", param=f"{where}.summary")
    sealed = _string(entry, "encrypted_content", where, required=False)
    restored = unseal(sealed) if sealed is not None else None
    if texts:
        text = "".join(texts)
        if restored is not None and restored != text:
            raise InvalidRequestError("encrypted_content does not match the reasoning text",
                                      param=f"{where}.encrypted_content")
    elif restored is not None:
        text = restored
    elif sealed is not None:
        raise UnsupportedFeatureError("this encrypted_content was not produced by this server and cannot be "
                                      "read; replay the raw reasoning_text instead", param=f"{where}.encrypted_content")
    else:
        raise UnsupportedFeatureError("a reasoning Item needs its raw reasoning_text (or this server's "
                                      "encrypted_content); a summary alone cannot be replayed",
                                      param=f"{where}.content")
    item: Item = {"summary": summary, "content": [{"type": "reasoning_text", "text": text}]}
    if sealed is not None:
        item["encrypted_content"] = sealed
    item["status"] = _status(entry, where, tool=False)
    return item


def _call(entry: Mapping[str, Any], where: str) -> Item:
    call_id = _string(entry, "call_id", where)
    name = _string(entry, "name", where)
    namespace = _string(entry, "namespace", where, required=False)
    arguments = entry.get("arguments")
    try:
        decoded = loads_json(arguments) if isinstance(arguments, str) else None
    except (JSONTooDeepError, LoneSurrogateError) as exc:
        raise InvalidRequestError(f"arguments: {exc}", param=f"{where}.arguments") from None
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise InvalidRequestError("arguments must be a JSON object in a string", param=f"{where}.arguments")
    item: Item = {"call_id": call_id, "name": name}
    if namespace is not None:
        item["namespace"] = namespace
    item.update(arguments=arguments, status=_status(entry, where, tool=True))
    return item


def _output(entry: Mapping[str, Any], where: str) -> Item:
    call_id = _string(entry, "call_id", where)
    output = entry.get("output")
    if isinstance(output, list) and output:
        output = [_part(part, f"{where}.output[{j}]", "tool") for j, part in enumerate(output)]
    elif not isinstance(output, str):
        raise InvalidRequestError("output must be a string or a non-empty array of parts", param=f"{where}.output")
    item: Item = {"call_id": call_id, "output": output}
    for key in ("name", "namespace"):
        value = _string(entry, key, where, required=False)
        if value is not None:
            item[key] = value
    item["status"] = _status(entry, where, tool=True)
    return item


def item_text(parts: Any) -> str:
    """The text a message's (or a tool result's) parts contribute, joined as-is."""
    if isinstance(parts, str):
        return parts
    return "".join(p.get("refusal", "") if p["type"] == "refusal" else p["text"] for p in parts)
