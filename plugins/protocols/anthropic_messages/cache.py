"""``cache_control`` markers: checked by Anthropic's rules, then handed to the context cache.

The engine publishes every full KV page of every prompt and reuses any exact prefix;
a breakpoint additionally makes the prefix up to its block a shared stable prefix the
context cache keeps (ninfer.engine.context_cache), so several conversations starting
with the same system prompt and tools keep reading it. A request whose markers break
the rules fails the way it would upstream. The rules: a marker is ``ephemeral`` with
a ``5m`` or ``1h`` TTL; at most four distinct block-level breakpoints; the top-level
marker targets the last cacheable block, where it merges with an explicit marker of the
same TTL, conflicts with one of another TTL, and otherwise takes a slot of its own.
A marker on a consumed billing block goes away with that block.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from ninfer.errors import InvalidRequestError

MAX_BREAKPOINTS = 4
TTLS = ("5m", "1h")
#: block types that cannot carry a breakpoint (thinking is not cached on its own)
_UNMARKABLE = ("thinking", "redacted_thinking")


def _ttl(marker: Any, where: str) -> str:
    if not isinstance(marker, Mapping) or marker.get("type") != "ephemeral":
        raise InvalidRequestError("cache_control.type must be ephemeral", param=f"{where}.type")
    ttl = marker.get("ttl", "5m")
    if ttl not in TTLS:
        raise InvalidRequestError(f"cache_control.ttl must be one of {', '.join(TTLS)}", param=f"{where}.ttl")
    return ttl


def _blocks(system: Any, skip_system: int, messages: Any, tools: Any) -> Iterator[tuple[Mapping[str, Any], str]]:
    """Every block that may carry ``cache_control``, with its path, in prompt order."""
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, Mapping):
            yield tool, f"tools[{i}]"
    if isinstance(system, list):
        for j, block in enumerate(system[skip_system:], skip_system):
            if isinstance(block, Mapping):
                yield block, f"system[{j}]"
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(block, Mapping):
                continue
            yield block, f"messages[{i}].content[{j}]"
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for k, nested in enumerate(inner if isinstance(inner, list) else ()):
                if isinstance(nested, Mapping):
                    yield nested, f"messages[{i}].content[{j}].content[{k}]"


def _last_target(messages: Any) -> str | None:
    """Where a request-level marker lands: the last block of the last message."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping):
        return None
    where = f"messages[{len(messages) - 1}].content"
    content = messages[-1].get("content")
    if isinstance(content, str):
        return where
    if isinstance(content, list):
        for j in range(len(content) - 1, -1, -1):
            block = content[j]
            if isinstance(block, Mapping) and block.get("type") not in _UNMARKABLE:
                return f"{where}[{j}]"
    return None


def check_cache_control(request_marker: Any, system: Any, skip_system: int, messages: Any, tools: Any) -> list[str]:
    """Validate every marker; returns the paths of the blocks the breakpoints sit on."""
    explicit: dict[str, str] = {}
    for block, path in _blocks(system, skip_system, messages, tools):
        marker = block.get("cache_control")
        if marker is None:
            continue
        if block.get("type") in _UNMARKABLE:
            raise InvalidRequestError(f"{block.get('type')} blocks cannot carry cache_control",
                                      param=f"{path}.cache_control")
        explicit[path] = _ttl(marker, f"{path}.cache_control")
        if len(explicit) > MAX_BREAKPOINTS:
            raise InvalidRequestError(f"at most {MAX_BREAKPOINTS} blocks may carry cache_control",
                                      param=f"{path}.cache_control")
    if request_marker is None:
        return list(explicit)
    ttl = _ttl(request_marker, "cache_control")
    target = _last_target(messages)
    if target is None:
        return list(explicit)  # nothing cacheable to mark: the hint has no effect
    if target in explicit:
        if explicit[target] != ttl:
            raise InvalidRequestError(f"cache_control (ttl {ttl}) conflicts with the ttl {explicit[target]} "
                                      f"already set on its target {target}", param="cache_control")
        return list(explicit)
    if len(explicit) == MAX_BREAKPOINTS:
        raise InvalidRequestError(f"cache_control needs a breakpoint slot, but {MAX_BREAKPOINTS} blocks already "
                                  "carry cache_control", param="cache_control")
    return [*explicit, target]


def breakpoint_turns(targets: list[str], message_turns: dict[int, int], system_turns: int) -> tuple[int, ...]:
    """Each marked block as a turn count (ninfer.frontend.pipeline_request.ChatPrompt.cache_breakpoints):
    a tool or system block marks the end of the system message; a message's block the end
    of the turns that message (with its same-role neighbours) lowered to."""
    turns = []
    for path in targets:
        if path.startswith(("tools[", "system[")):
            turns.append(system_turns)
        else:  # messages[i]...
            index = int(path[len("messages["):path.index("]")])
            turns.append(system_turns + message_turns[index])
    return tuple(sorted(set(turns)))
