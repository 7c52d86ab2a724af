"""Qwen3 / Hermes tool calls written as one JSON object per tag pair.

::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

The body is :class:`ninfer.frontend.json_call.JsonCallBody`; this plugin names the markers.
"""

from __future__ import annotations

from ninfer.capabilities import ToolParser
from ninfer.frontend.json_call import JsonCallBody
from ninfer.frontend.tool_regions import CallBody, TaggedToolParser
from ninfer.hookspecs import hookimpl
from ninfer_plugins.tool_parsers.hermes_json_grammar import hermes_grammar
from ninfer_plugins.tool_parsers.markers import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class HermesJsonToolParser(TaggedToolParser):
    """``HermesJsonToolParser(tools, tolerant=False)``: see :mod:`ninfer.frontend.tool_regions`."""

    open_marker, close_marker = TOOL_CALL_OPEN, TOOL_CALL_CLOSE

    def new_body(self, start: int) -> CallBody:
        return JsonCallBody(self.tools, self.tolerant, start)


@hookimpl
def register_tool_parsers(register):
    register(
        ToolParser(
            name="hermes_json",
            description='Qwen3/Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> tool calls',
            factory=HermesJsonToolParser,
            grammar=hermes_grammar,
        )
    )
