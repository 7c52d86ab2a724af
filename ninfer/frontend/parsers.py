"""Which reasoning and tool-call parsers split a request's output, and how they start.

The profile's choice wins over the model family's; both name plugins in the registry.
A tool parser only runs when the request made tools callable, so undeclared tool
markup in an answer stays text.
"""

from __future__ import annotations

from typing import Any, Sequence

from ninfer.capabilities import ReasoningParser
from ninfer.frontend.output_split import OutputSplitter
from ninfer.frontend.tool_schema import ToolSpec


def reasoning_parser(state: Any) -> ReasoningParser | None:
    name = state.profile.reasoning.parser or getattr(state.family, "reasoning_parser", None)
    return state.registry.get("reasoning_parser", name, key="reasoning.parser") if name else None


def tool_specs(tools: Sequence[dict[str, Any]]) -> list[ToolSpec]:
    """Template-shaped function tools -> what the tool parsers match calls against."""
    return [ToolSpec(t["function"]["name"], t["function"].get("parameters") or {}) for t in tools]


def starts_in_reasoning(prompt: str, parser: ReasoningParser | None) -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model to continue."""
    return parser is not None and prompt.rfind(parser.start) > prompt.rfind(parser.end)


def make_splitter(state: Any, prompt: str, tools: Sequence[dict[str, Any]]) -> OutputSplitter:
    """A fresh splitter for one choice of a request rendered as ``prompt``."""
    reasoning = reasoning_parser(state)
    tool_parser = None
    if tools:
        name = state.profile.tools.parser or getattr(state.family, "tool_parser", None)
        if name:
            plugin = state.registry.get("tool_parser", name, key="tools.parser")
            tool_parser = plugin.factory(tool_specs(tools), tolerant=state.profile.tools.tolerant_tool_calls)
    return OutputSplitter(reasoning, tool_parser, starts_in_reasoning(prompt, reasoning))
