"""Capping reasoning length: at the budget the engine closes the reasoning itself.

The protocol layer decides the budget and the exact close tokens (see
:mod:`ninfer.frontend.thinking`); the engine only counts reasoning tokens and, when the
budget is reached with reasoning still open, commits the close tokens without sampling
them. They count as output and the model continues after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ThinkingBudget:
    budget: int  # reasoning tokens allowed before the forced close
    end_id: int  # the token that closes reasoning naturally
    close_ids: list[int] = field(default_factory=list)  # guidance + close marker to insert
    open_at_start: bool = True  # the prompt leaves reasoning open
    start_id: Optional[int] = None  # a model may open reasoning itself with this first token


class ThinkingBudgetTracker:
    """Per-request state: is reasoning open, how long has it run."""

    def __init__(self, spec: ThinkingBudget):
        self.spec = spec
        self.open = spec.open_at_start
        self.count = 0
        self.done = False
        self.applied = False  # whether the close was forced (for diagnostics)

    def may_close_within(self, tokens: int) -> bool:
        """Whether counting ``tokens`` more sampled tokens could reach the budget and force
        the close. A decode step launched ahead samples after a token the host has not
        counted yet, which is safe only when that token cannot be the one."""
        return not self.done and self.spec.budget - self.count <= tokens

    def on_token(self, token_id: int, output_index: int) -> list[int]:
        """Account one sampled token; returns the tokens to insert after it (maybe none)."""
        if self.done:
            return []
        if not self.open:
            if output_index == 0 and token_id == self.spec.start_id:
                self.open = True
                return []
            self.done = True  # reasoning never opened: nothing to cap
            return []
        if token_id == self.spec.end_id:
            self.done = True
            return []
        self.count += 1
        if self.count >= self.spec.budget:
            self.done = self.applied = True
            return list(self.spec.close_ids)
        return []
