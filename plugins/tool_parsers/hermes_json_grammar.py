"""The tool-call grammar of the ``hermes_json`` format.

Each call body is one JSON object ``{"name": NAME, "arguments": {...}}``, embedded as
``%json`` with the name fixed and the arguments under :func:`argument_schema`.
Definitions (``$defs`` / ``definitions``) of the arguments schema move to the root of
the embedded schema, so ``$ref`` s into them still resolve.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.tool_parsers.grammar_common import (
    argument_schema,
    build_grammar,
    check_name,
    check_schema,
    embedded_json,
)

_DEFINITIONS = ("$defs", "definitions")


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one call object of ``tool``."""
    arguments = argument_schema(tool)
    if tool.strict:
        check_schema(arguments, tool.param)
    hoisted = {key: arguments[key] for key in _DEFINITIONS if key in arguments}
    arguments = {k: v for k, v in arguments.items() if k not in hoisted}
    return {
        **hoisted,
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _body(tool: ToolSpec, rule: str) -> str:
    check_name(tool.name, tool.param)
    return f"{rule}: {embedded_json(call_schema(tool))}"


def hermes_grammar(tools: Sequence[ToolSpec], mode: str, *, parallel: bool = True,
                   answer: Optional[GuideSpec] = None) -> GuideSpec:
    """:attr:`ninfer.capabilities.ToolParser.grammar` for hermes_json."""
    return build_grammar(tools, mode, _body, parallel=parallel, answer=answer)
