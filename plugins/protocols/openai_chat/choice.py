"""The pipeline's per-choice output in OpenAI's shapes: finish reasons, log probabilities, usage, timings.

Chat (streaming and aggregate) and legacy completions share these, so their usage and
timings agree field for field.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from ninfer.frontend.choice_output import ChoiceProgress, timings as timing_counts, usage as usage_counts
from ninfer.outputs import PositionLogprobs
from ninfer_plugins.protocols.openai_chat.schema import (
    CompletionTokensDetails,
    PromptTokensDetails,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def finish_reason(choice: ChoiceProgress) -> str | None:
    """OpenAI's reason: a normal stop after tool calls is ``tool_calls``."""
    if choice.finish_reason == "stop" and choice.called_tools:
        return "tool_calls"
    return choice.finish_reason


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def wire_logprobs(tokenizer: Any, positions: Sequence[PositionLogprobs] | None) -> list[TokenLogprob]:
    """OpenAI-shaped entries for the sampled tokens of one event."""
    out = []
    for pos in positions or ():
        top = [TopLogprob(t.token, t.logprob, t.bytes) for t in pos.top]
        out.append(TokenLogprob(token_text(tokenizer, pos.token_id), pos.logprob,
                                list(tokenizer.token_bytes(pos.token_id)), top))
    return out


def usage(choices: Sequence[ChoiceProgress], per_prompt: int | None = None) -> Usage:
    """Each prompt counts once (its choices share it; default: one prompt); outputs add up."""
    counts = usage_counts(choices, per_prompt or len(choices) or 1)
    return Usage(
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        total_tokens=counts.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=counts.reasoning_tokens),
    )


def timings(choices: Sequence[ChoiceProgress], now: float | None = None) -> Timings:
    """llama.cpp-style timings (see :func:`ninfer.frontend.choice_output.timings`)."""
    counts = attrs.asdict(timing_counts(choices, now))
    return Timings(**{k: v for k, v in counts.items() if v is not None})  # no draft figures without drafts
