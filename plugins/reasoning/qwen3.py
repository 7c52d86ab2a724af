"""Qwen's ``<think>...</think>`` reasoning channel."""

from ninfer.capabilities import ReasoningParser
from ninfer.hookspecs import hookimpl


@hookimpl
def register_reasoning_parsers(register):
    register(ReasoningParser(name="qwen3", description="Qwen <think>...</think> reasoning", start="<think>", end="</think>"))
