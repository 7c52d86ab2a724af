"""Thinking budgets: which requests get one, and the exact tokens that close reasoning."""

from __future__ import annotations

from typing import Optional

from ninfer.capabilities import ReasoningParser
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import InvalidRequestError


def single_token(tokenizer, text: str, what: str) -> int:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise InvalidRequestError(f"the reasoning {what} marker {text!r} is not a single token in this tokenizer",
                                  param="thinking", code="thinking_budget_not_supported")
    return ids[0]


def thinking_budget(
    tokenizer,
    parser: Optional[ReasoningParser],
    budget: Optional[int],
    max_tokens: Optional[int],
    open_at_start: bool,
    param: str = "thinking",
) -> Optional[ThinkingBudget]:
    """The engine-side budget for a thinking-enabled request, or None when uncapped.

    When the output budget reaches past the cap but cannot hold the whole close sequence
    plus one more model token, the request is rejected rather than partly closed.
    """
    if budget is None or parser is None:
        return None
    close_ids = tokenizer.encode(parser.budget_close)
    reach = budget + (0 if open_at_start else 1)  # a model-emitted opener is output too
    if max_tokens is not None and reach < max_tokens < reach + len(close_ids) + 1:
        raise InvalidRequestError(
            f"max tokens ({max_tokens}) leave no room after the thinking budget ({budget}) for the "
            f"{len(close_ids)} close tokens and one answer token",
            param=param,
            code="thinking_budget_capacity_insufficient",
        )
    return ThinkingBudget(
        budget=budget,
        end_id=single_token(tokenizer, parser.end, "end"),
        close_ids=close_ids,
        open_at_start=open_at_start,
        start_id=single_token(tokenizer, parser.start, "start"),
    )
