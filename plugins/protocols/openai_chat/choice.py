"""One choice's engine events -> typed deltas, log probabilities, usage and timings.

Streaming and aggregate rendering both consume :meth:`ChoiceState.feed`, so the
concatenated stream equals the aggregate response by construction. The legacy
completions endpoint uses it without a splitter (its text is never split).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ninfer.engine.request import GenerationEvent, RequestTimings
from ninfer.frontend.output_split import Delta, OutputSplitter, TextDelta, ToolCallStart
from ninfer.outputs import PositionLogprobs
from ninfer_plugins.protocols.openai_chat.schema import (
    CompletionTokensDetails,
    PromptTokensDetails,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)


class ChoiceState:
    """Everything one engine request has produced so far."""

    def __init__(self, index: int, tokenizer: Any, splitter: OutputSplitter | None = None):
        self.index = index
        self.tokenizer = tokenizer
        self.splitter = splitter
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prompt_processed = 0
        self.timings: RequestTimings | None = None
        self.finished_at: float | None = None
        self.engine_finish: str | None = None
        self.stop_reason: object = None
        self.called_tools = False

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter is not None else 0

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's reason: a normal stop after tool calls is ``tool_calls``."""
        if self.engine_finish == "stop" and self.called_tools:
            return "tool_calls"
        return self.engine_finish

    def feed(self, event: GenerationEvent) -> list[Delta]:
        """Account one event; returns the deltas it released (all remaining ones at the end)."""
        if event.error is not None:
            raise event.error
        self.prompt_tokens = event.num_prompt_tokens
        self.cached_tokens = event.num_cached_tokens
        self.completion_tokens = event.num_output_tokens
        self.prompt_processed = max(self.prompt_processed, event.prompt_processed)
        self.timings = event.timings
        deltas: list[Delta]
        if self.splitter is None:
            deltas = [TextDelta(event.text)] if event.text else []
        else:
            deltas = self.splitter.feed(event.text, len(event.token_ids)) if event.text or event.token_ids else []
            if event.finished:
                deltas += self.splitter.finish()
        if event.finished:
            self.finished_at = time.monotonic()
            self.engine_finish, self.stop_reason = event.finish_reason, event.stop_reason
        self.called_tools = self.called_tools or any(isinstance(d, ToolCallStart) for d in deltas)
        return deltas

    def logprobs(self, positions: Sequence[PositionLogprobs] | None) -> list[TokenLogprob]:
        """OpenAI-shaped entries for the sampled tokens of one event."""
        out = []
        for pos in positions or ():
            top = [TopLogprob(t.token, t.logprob, t.bytes) for t in pos.top]
            out.append(TokenLogprob(self.token_text(pos.token_id), pos.logprob,
                                    list(self.tokenizer.token_bytes(pos.token_id)), top))
        return out

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def usage(choices: Sequence[ChoiceState]) -> Usage:
    """The prompt counts once (every choice shares it); outputs add up."""
    first = choices[0]
    completion = sum(c.completion_tokens for c in choices)
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=first.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=sum(c.reasoning_tokens for c in choices)),
    )


def _rate(count: int, ms: float) -> float:
    return count * 1000.0 / ms if count > 0 and ms > 0 else 0.0


def _per_token(ms: float, count: int) -> float:
    return ms / count if count > 0 else 0.0


def timings(choices: Sequence[ChoiceState], now: float | None = None) -> Timings:
    """llama.cpp-style timings; finite zeros wherever a denominator is zero.

    Prompt time runs from admission to the first output token (to the end when none was
    generated); it is the first choice's, as is the prompt split. Generation time runs
    from the earliest first token to the latest token and counts one interval fewer
    than tokens per choice, since each first token belongs to prompt latency.
    """
    now = time.monotonic() if now is None else now
    first = choices[0]
    t = first.timings
    prompt_ms = 0.0
    if t is not None and t.admitted is not None:
        prompt_end = t.first_token if t.first_token is not None else (first.finished_at or now)
        prompt_ms = max(prompt_end - t.admitted, 0.0) * 1000.0
    prompt_n = first.prompt_tokens - first.cached_tokens
    starts = [c.timings.first_token for c in choices if c.timings and c.timings.first_token is not None]
    ends = [c.timings.last_token for c in choices if c.timings and c.timings.last_token is not None]
    predicted_ms = max(max(ends) - min(starts), 0.0) * 1000.0 if starts and ends else 0.0
    predicted_n = sum(c.completion_tokens for c in choices)
    intervals = sum(max(c.completion_tokens - 1, 0) for c in choices)
    return Timings(
        cache_n=first.cached_tokens,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=_per_token(prompt_ms, prompt_n),
        prompt_per_second=_rate(prompt_n, prompt_ms),
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=_per_token(predicted_ms, intervals),
        predicted_per_second=_rate(intervals, predicted_ms),
    )
