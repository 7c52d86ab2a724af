"""Refusing a prompt that cannot fit the context, the same way at every front door."""

from __future__ import annotations

from ninfer.errors import ContextLengthExceededError


def check_prompt_length(prompt_tokens: int, max_context: int, param: str = "messages") -> None:
    """A rendered prompt longer than the context is the prompt's fault, whatever max_tokens says."""
    if prompt_tokens > max_context:
        raise ContextLengthExceededError(
            f"the prompt has {prompt_tokens} tokens; the context holds {max_context}", param=param
        )
