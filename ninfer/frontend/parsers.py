"""Which reasoning and tool-call parsers split a request's output, and how they start.

The profile's choice wins over the model family's; both name plugins in the registry.
A tool parser only runs when the request made tools callable, so undeclared tool
markup in an answer stays text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ninfer.capabilities import ReasoningParser
from ninfer.frontend.output_split import OutputSplitter
from ninfer.frontend.tool_schema import ToolSpec

if TYPE_CHECKING:
    from ninfer.frontend.host import ModelHost


def reasoning_parser(host: ModelHost) -> ReasoningParser | None:
    name = host.profile.reasoning.parser or getattr(host.family, "reasoning_parser", None)
    return host.registry.get("reasoning_parser", name, key="reasoning.parser") if name else None


def tool_specs(tools: Sequence[dict[str, Any]]) -> list[ToolSpec]:
    """Template-shaped function tools -> what the tool parsers match calls against."""
    return [ToolSpec(t["function"]["name"], t["function"].get("parameters") or {}) for t in tools]


def starts_in_reasoning(prompt: str, parser: ReasoningParser | None) -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model to continue."""
    return parser is not None and prompt.rfind(parser.start) > prompt.rfind(parser.end)


def make_splitter(host: ModelHost, prompt: str, tools: Sequence[dict[str, Any]]) -> OutputSplitter:
    """A fresh splitter for one choice of a request rendered as ``prompt``."""
    reasoning = reasoning_parser(host)
    tool_parser = None
    if tools:
        name = host.profile.tools.parser or getattr(host.family, "tool_parser", None)
        if name:
            plugin = host.registry.get("tool_parser", name, key="tools.parser")
            tool_parser = plugin.factory(tool_specs(tools), tolerant=host.profile.tools.tolerant_tool_calls)
    return OutputSplitter(reasoning, tool_parser, starts_in_reasoning(prompt, reasoning))
