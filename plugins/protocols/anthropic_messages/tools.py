"""User-defined tools and ``tool_choice`` -> the function definitions the chat template renders.

Only client tools the model may call freely are executable: ninfer has no constrained
decoding to force a call or follow a strict schema, and no executor for Anthropic's
server tools, MCP or toolsets, so those are refused naming the field.
"""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError


def _unsupported(param: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{what} is not supported", param=param)


def tools_enabled(tool_choice: Any) -> bool:
    """False for ``{"type": "none"}``; raises for choices that cannot be honoured."""
    if tool_choice is None:
        return True
    if not isinstance(tool_choice, Mapping):
        raise InvalidRequestError("tool_choice must be an object", param="tool_choice")
    kind = tool_choice.get("type")
    if kind in ("any", "tool"):
        raise _unsupported("tool_choice.type", f"tool_choice {kind!r} (forcing a tool call)")
    if kind not in ("auto", "none"):
        raise InvalidRequestError("tool_choice.type must be auto, none, any or tool", param="tool_choice.type")
    if tool_choice.get("disable_parallel_tool_use"):
        raise _unsupported("tool_choice.disable_parallel_tool_use", "limiting a response to one tool call")
    return kind == "auto"


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
    if tool.get("strict"):
        raise _unsupported(f"{where}.strict", "strict schema-following tool input")
    if tool.get("defer_loading"):
        raise _unsupported(f"{where}.defer_loading", "deferred tool loading")
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
        raise _unsupported(f"{where}.allowed_callers", "a tool the model may not call directly")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a tool needs a name", param=f"{where}.name")
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
