"""Responses tool definitions and ``tool_choice`` -> the effective, callable tool set.

Functions may be declared directly or grouped in a namespace. The model sees one flat
list, so each namespace/function pair gets its own model-facing name,
``namespace.function``: OpenAI function and namespace names cannot contain a dot, so
the name is unambiguous, and the same function name may live in several namespaces.
Output and replayed Items carry the separate ``namespace`` and ``name`` again.

Hosted tools (web search, file search, ...) run on OpenAI's side; this server cannot
run them and the model cannot call them, so a merely offered one is left out of the
effective set with a warning, while a ``tool_choice`` that forces or allows one is
refused. Custom free-form tools are client tools whose grammar cannot be honoured:
refused. A required or named ``tool_choice``, ``parallel_tool_calls: false`` and strict
functions are enforced by a tool-call grammar (:mod:`ninfer.frontend.tool_guide`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import attrs
from loguru import logger

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError, type_field
from ninfer.frontend.tool_grammar import check_name
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.frontend.tool_guide import ToolRequest

HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer", "computer_use", "computer_use_preview", "mcp",
    "local_shell", "shell", "apply_patch", "tool_search",
})


@attrs.frozen
class ToolIdentity:
    name: str
    namespace: Optional[str] = None

    @property
    def model_name(self) -> str:
        return model_name(self.name, self.namespace)


def model_name(name: str, namespace: Optional[str]) -> str:
    """The name the model writes for a (namespace, function) pair."""
    return f"{namespace}.{name}" if namespace else name


@attrs.frozen
class ToolSet:
    #: callable definitions in chat-template shape, in declaration order
    definitions: list[dict[str, Any]]
    #: model-facing name -> identity, for the callable ones
    identities: dict[str, ToolIdentity]
    #: what the request asks of its calls (tool grammar input)
    request: ToolRequest = ToolRequest()


@attrs.frozen
class _Declared:
    identity: ToolIdentity
    definition: dict[str, Any]
    where: str
    strict: bool = False

    def spec(self) -> ToolSpec:
        fn = self.definition["function"]
        return ToolSpec(fn["name"], fn.get("parameters") or {}, strict=self.strict, param=f"{self.where}.parameters")


def _unsupported(param: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{param}: {what}", param=param)


def _function(tool: Mapping[str, Any], where: str, namespace: Optional[str], group_text: Optional[str]) -> _Declared:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a function needs a non-empty name", param=f"{where}.name")
    check_name(model_name(name, namespace), f"{where}.name")  # else never called, whatever tool_choice
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("strict must be a boolean", param=f"{where}.strict")
    if tool.get("defer_loading") is True:
        raise _unsupported(f"{where}.defer_loading", "deferred tool loading is not supported")
    if tool.get("output_schema") is not None:
        raise _unsupported(f"{where}.output_schema", "tool output schemas are not supported")
    callers = tool.get("allowed_callers")
    if callers is not None and "direct" not in callers:
        raise _unsupported(f"{where}.allowed_callers", "the model can only call tools directly")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError("description must be a string", param=f"{where}.description")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError("parameters must be a JSON schema object", param=f"{where}.parameters")
    identity = ToolIdentity(name, namespace)
    # the namespace's own description is the only place the model learns what the group is for
    text = "\n\n".join(t for t in (group_text, description) if t)
    definition: dict[str, Any] = {"name": identity.model_name}
    if text:
        definition["description"] = text
    if parameters is not None:
        definition["parameters"] = parameters
    return _Declared(identity, {"type": "function", "function": definition}, where, strict is True)


def _declared(tools: Sequence[Any]) -> tuple[list[_Declared], list[str]]:
    """Every declared function (namespaces expanded) and the hosted tool types offered."""
    out: list[_Declared] = []
    hosted: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError("a tool must be an object", param=where)
        kind = type_field(tool, where)
        if kind == "function":
            out.append(_function(tool, where, None, None))
        elif kind == "namespace":
            out.extend(_namespace(tool, where))
        elif kind == "custom":
            raise _unsupported(f"{where}.type", "custom free-form tools are not supported, only functions")
        elif kind in HOSTED_TOOLS:
            hosted.append(kind)
        else:
            raise InvalidRequestError(f"tool type {kind!r} is not recognised", param=f"{where}.type")
    seen: dict[str, str] = {}
    for d in out:
        first = seen.setdefault(d.identity.model_name, d.where)
        if first != d.where:
            raise InvalidRequestError(f"{d.where} has the same identity as {first} ({d.identity.model_name!r})",
                                      param=d.where)
    return out, hosted


def _namespace(tool: Mapping[str, Any], where: str) -> list[_Declared]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a namespace needs a non-empty name", param=f"{where}.name")
    check_name(name, f"{where}.name", "namespace name")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError("description must be a string", param=f"{where}.description")
    members = tool.get("tools")
    if not isinstance(members, list):
        raise InvalidRequestError("a namespace needs a tools array", param=f"{where}.tools")
    out = []
    for j, member in enumerate(members):
        inner = f"{where}.tools[{j}]"
        if not isinstance(member, Mapping) or member.get("type") != "function":
            raise _unsupported(f"{inner}.type", "namespaces may only hold function tools")
        out.append(_function(member, inner, name, description))
    return out


def _reference(entry: Mapping[str, Any], known: set[ToolIdentity], where: str) -> ToolIdentity:
    """A declared function named by ``name`` (and ``namespace`` for a namespace member)."""
    identity = ToolIdentity(entry.get("name"), entry.get("namespace"))  # type: ignore[arg-type]
    if identity not in known:
        raise InvalidRequestError(f"no function {identity.model_name!r} is declared", param=where)
    return identity


@attrs.frozen
class _Choice:
    #: identities left callable (None: every declared one)
    allowed: Optional[set[ToolIdentity]] = None
    #: a call is required
    forced: bool = False
    #: the one function a named choice forces; the others stay in the prompt
    named: Optional[ToolIdentity] = None


def _choice(choice: Any, declared: list[_Declared]) -> _Choice:
    """What ``tool_choice`` asks of the declared functions."""
    if choice is None or choice in ("auto", "required"):
        return _Choice(forced=choice == "required")
    if choice == "none":
        return _Choice(set())
    if not isinstance(choice, Mapping):
        raise InvalidRequestError("tool_choice must be auto, none, required, or an object", param="tool_choice")
    kind = type_field(choice, "tool_choice")
    known = {d.identity for d in declared}
    if kind == "function":
        return _Choice(forced=True, named=_reference(choice, known, "tool_choice.name"))
    if kind in HOSTED_TOOLS or kind == "custom":
        raise _unsupported("tool_choice", f"{kind!r} tools cannot be called by this server's model")
    if kind != "allowed_tools":
        raise InvalidRequestError(f"tool_choice type {kind!r} is not recognised", param="tool_choice.type")
    mode = choice.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise InvalidRequestError("tool_choice.mode must be auto or required", param="tool_choice.mode")
    entries = choice.get("tools")
    if not isinstance(entries, list):
        raise InvalidRequestError("allowed_tools needs a tools array", param="tool_choice.tools")
    allowed = set()
    for j, entry in enumerate(entries):
        where = f"tool_choice.tools[{j}]"
        if not isinstance(entry, Mapping):
            raise InvalidRequestError("an allowed tool must be an object", param=where)
        if entry.get("type") != "function":
            raise _unsupported(where, "only function tools can be allowed")
        allowed.add(_reference(entry, known, where))
    return _Choice(allowed, mode == "required")


def resolve_tools(tools: Optional[Sequence[Any]], tool_choice: Any, parallel_tool_calls: Optional[bool]) -> ToolSet:
    """The callable tools of a request, checking every definition and the choice."""
    declared, hosted = _declared(tools or [])
    choice = _choice(tool_choice, declared)
    if hosted:
        logger.warning("leaving out {} hosted tool(s) the model cannot call: {}", len(hosted), ", ".join(hosted))
    effective = [d for d in declared if choice.allowed is None or d.identity in choice.allowed]
    callable_specs = [d.spec() for d in effective if choice.named is None or d.identity == choice.named]
    request = ToolRequest(callable_specs, forced=choice.forced, parallel=parallel_tool_calls is not False)
    return ToolSet([d.definition for d in effective], {d.identity.model_name: d.identity for d in effective},
                   request)
