"""The tool-call grammar of the ``hermes_json`` format.

Each call body is one JSON object ``{"name": NAME, "arguments": {...}}``, embedded as
``%json`` (:func:`ninfer.frontend.tool_grammar.json_call_schema`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec
from ninfer.frontend.tool_grammar import build_grammar, check_name, embedded_json, json_call_schema
from ninfer_plugins.tool_parsers.markers import TOOL_CALL_GRAMMAR

def _body(tool: ToolSpec, rule: str) -> str:
    check_name(tool.name, tool.param)
    return f"{rule}: {embedded_json(json_call_schema(tool))}"


def hermes_grammar(tools: Sequence[ToolSpec], mode: str, *, parallel: bool = True,
                   answer: Optional[GuideSpec] = None) -> GuideSpec:
    """:attr:`ninfer.capabilities.ToolParser.grammar` for hermes_json."""
    return build_grammar(tools, mode, _body, parallel=parallel, markers=TOOL_CALL_GRAMMAR, answer=answer)
