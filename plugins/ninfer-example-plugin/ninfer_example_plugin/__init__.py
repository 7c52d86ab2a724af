"""Example third-party plugin: a reasoning parser for models that think in brackets.

Copy this package to start your own plugin: its pyproject.toml declares the entry
point, this module implements one hook.
"""

from ninfer.capabilities import ReasoningParser
from ninfer.hookspecs import hookimpl


@hookimpl
def register_reasoning_parsers(register):
    register(
        ReasoningParser(
            name="bracket_think",
            description="reasoning between [THINK] and [/THINK]",
            start="[THINK]",
            end="[/THINK]",
            # committed when a thinking budget runs out: the close marker, then the answer's separator
            budget_close="\n[/THINK]\n\n",
        )
    )
