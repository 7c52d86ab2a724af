"""Qwen's ``<think>...</think>`` reasoning channel."""

from ninfer.capabilities import ReasoningParser
from ninfer.hookspecs import hookimpl

#: Qwen3's markers; a budget that runs out commits Qwen's own wording for ending early, then
#: the close marker and the blank line its template puts before the answer
QWEN3 = ReasoningParser(
    name="qwen3",
    description="Qwen <think>...</think> reasoning",
    start="<think>",
    end="</think>",
    budget_close="\n\nConsidering the limited time, I have to give the solution based on the thinking directly "
                 "now.\n</think>\n\n",
)


@hookimpl
def register_reasoning_parsers(register):
    register(QWEN3)
