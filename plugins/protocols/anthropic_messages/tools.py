"""User-defined tools and ``tool_choice`` -> the function definitions the chat template renders.

Client tools are executable, including forced (``any``), named (``tool``), single-call
and strict ones, which a tool-call grammar enforces
(:mod:`ninfer.frontend.tool_guide`). ninfer has no executor for Anthropic's
server tools, MCP or toolsets, so those are refused naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.frontend.tool_guide import ToolRequest

CHOICE_TYPES = ("auto", "none", "any", "tool")
#: the tool names Anthropic's API accepts; every one of them is also one the tool parsers
#: read back (ninfer.frontend.tool_regions.valid_name)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


def _unsupported(param: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{what} is not supported", param=param)


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: ``kind`` auto, none, any or tool (``name`` set for tool)."""

    kind: str = "auto"
    name: Optional[str] = None
    parallel: bool = True

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def parse_tool_choice(tool_choice: Any) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice()
    if not isinstance(tool_choice, Mapping):
        raise InvalidRequestError("tool_choice must be an object", param="tool_choice")
    kind = tool_choice.get("type")
    if kind not in CHOICE_TYPES:
        raise InvalidRequestError("tool_choice.type must be auto, none, any or tool", param="tool_choice.type")
    name = tool_choice.get("name")
    if kind == "tool" and (not isinstance(name, str) or not name):
        raise InvalidRequestError("tool_choice of type tool needs a name", param="tool_choice.name")
    single = tool_choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise InvalidRequestError("disable_parallel_tool_use must be a boolean",
                                  param="tool_choice.disable_parallel_tool_use")
    return ToolChoice(kind, name if kind == "tool" else None, not single)


def tool_request(tools: Any, definitions: list[dict[str, Any]], choice: ToolChoice) -> ToolRequest:
    """What the choice asks of calls to ``definitions`` (the validated ``tools``, in order)."""
    if not choice.enabled:
        return ToolRequest()
    specs = [ToolSpec(d["function"]["name"], d["function"]["parameters"], strict=tools[i].get("strict") is True,
                      param=f"tools[{i}].input_schema") for i, d in enumerate(definitions)]
    if choice.name is not None:
        specs = [s for s in specs if s.name == choice.name]
        if not specs:
            raise InvalidRequestError(f"no tool named {choice.name!r} is declared", param="tool_choice.name")
    single = "tool_choice.disable_parallel_tool_use"
    return ToolRequest(specs, forced=choice.kind in ("any", "tool"), parallel=choice.parallel,
                       choice_param="tool_choice", parallel_param=single)


def template_tools(tools: Any) -> list[dict[str, Any]]:
    """Validated tools in the chat template's function shape, in declaration order."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be an array", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        definition = _tool(tool, f"tools[{i}]")
        if definition["name"] in names:
            raise InvalidRequestError(f"tool name {definition['name']!r} is declared twice", param=f"tools[{i}].name")
        names.add(definition["name"])
        out.append({"type": "function", "function": definition})
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError("each tool must be an object", param=where)
    kind = tool.get("type")
    if kind == "mcp_toolset":
        raise _unsupported(f"{where}.type", "MCP toolsets")
    if kind not in (None, "custom"):
        raise _unsupported(f"{where}.type", f"the Anthropic-provided tool {kind!r} (ninfer has no server tools)")
    if tool.get("strict") is not None and not isinstance(tool.get("strict"), bool):
        raise InvalidRequestError("strict must be a boolean", param=f"{where}.strict")
    if tool.get("defer_loading"):
        raise _unsupported(f"{where}.defer_loading", "deferred tool loading")
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
        raise _unsupported(f"{where}.allowed_callers", "a tool the model may not call directly")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a tool needs a name", param=f"{where}.name")
    if not TOOL_NAME.fullmatch(name):  # whatever tool_choice: a name is checked once, where declared
        raise InvalidRequestError(f"tool name {name!r} must be 1 to 128 letters, digits, '_' or '-'",
                                  param=f"{where}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise InvalidRequestError("input_schema must be a JSON schema object with type object",
                                  param=f"{where}.input_schema")
    definition: dict[str, Any] = {"name": name}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequestError("description must be a string", param=f"{where}.description")
        definition["description"] = description
    definition["parameters"] = dict(schema)
    examples = tool.get("input_examples")
    if examples is not None:
        if not isinstance(examples, list) or not all(isinstance(e, Mapping) for e in examples):
            raise InvalidRequestError("input_examples must be an array of objects", param=f"{where}.input_examples")
        if examples:
            definition["input_examples"] = list(examples)  # rendered with the definition
    return definition
