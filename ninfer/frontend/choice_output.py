"""One choice's engine events -> protocol-neutral output events, usage and timings.

:class:`ChoiceProgress` accounts one engine request: it runs the choice's splitter (none:
the text passes as it is) and keeps the counts every protocol reports. Each engine
event becomes one :class:`ChoiceEvent`; streaming and aggregate renderers consume the
same events, so a concatenated stream equals the aggregate by construction.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import attrs

from ninfer.engine.request import GenerationEvent, RequestTimings
from ninfer.frontend.output_split import Delta, OutputSplitter, TextDelta, ToolCallStart
from ninfer.outputs import PositionLogprobs


class ChoiceProgress:
    """Everything one engine request has produced so far."""

    def __init__(self, index: int, splitter: Optional[OutputSplitter] = None):
        self.index = index
        self.splitter = splitter
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = self.prompt_processed = 0
        self.timings: Optional[RequestTimings] = None
        self.output_ids: list[int] = []
        self.finished_at: Optional[float] = None
        #: the engine's reason (stop, length, abort, error) and matched stop string / token
        self.finish_reason: Optional[str] = None
        self.stop_reason: object = None
        self.called_tools = False
        self.started = False
        #: seconds between this choice's token-carrying events, as the event loop received
        #: them (the inter-token latency metric); one entry per event after the first
        self.token_gaps: list[float] = []
        self._last_tokens_at: Optional[float] = None

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter is not None else 0

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def feed(self, event: GenerationEvent) -> ChoiceEvent:
        """Account one engine event (raising its error, if it carries one)."""
        if event.error is not None:
            raise event.error
        first = not self.started
        self.started = True
        self.prompt_tokens, self.cached_tokens = event.num_prompt_tokens, event.num_cached_tokens
        self.completion_tokens = event.num_output_tokens
        self.prompt_processed = max(self.prompt_processed, event.prompt_processed)
        self.timings = event.timings
        self.output_ids += event.token_ids
        if event.token_ids:
            now = time.monotonic()
            if self._last_tokens_at is not None:
                self.token_gaps.append(now - self._last_tokens_at)
            self._last_tokens_at = now
        deltas: list[Delta]
        if self.splitter is None:
            deltas = [TextDelta(event.text)] if event.text else []
        else:
            deltas = self.splitter.feed(event.text, len(event.token_ids)) if event.text or event.token_ids else []
            if event.finished:
                deltas += self.splitter.finish()
        if event.finished:
            self.finished_at = time.monotonic()
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        self.called_tools = self.called_tools or any(isinstance(d, ToolCallStart) for d in deltas)
        return ChoiceEvent(self, deltas, list(event.token_ids), event.logprobs, event.prompt_logprobs, first,
                           event.finished)


@attrs.frozen
class ChoiceEvent:
    """What one engine event released for one choice."""

    #: the choice's running state after this event
    choice: ChoiceProgress
    deltas: list[Delta]
    #: output tokens committed by this event (their text may still be held back)
    token_ids: list[int]
    logprobs: Optional[list[PositionLogprobs]]
    #: the prompt's log probabilities, once (when the request asked for them)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    #: the choice's first event: the engine admitted it (its cache hit is final)
    first: bool
    finished: bool

    @property
    def index(self) -> int:
        return self.choice.index


@attrs.frozen
class UsageCounts:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage(choices: Sequence[ChoiceProgress], per_prompt: int = 1) -> UsageCounts:
    """A prompt counts once (its ``per_prompt`` choices share it); outputs add up."""
    heads = choices[::per_prompt]
    return UsageCounts(sum(c.prompt_tokens for c in heads), sum(c.cached_tokens for c in heads),
                       sum(c.completion_tokens for c in choices), sum(c.reasoning_tokens for c in choices))


@attrs.frozen
class TimingCounts:
    """llama.cpp's timing figures."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    #: speculative decoding (llama.cpp's names): tokens drafted, and how many were kept;
    #: None when nothing was drafted
    draft_n: Optional[int] = None
    draft_n_accepted: Optional[int] = None


def _rate(count: int, ms: float) -> float:
    return count * 1000.0 / ms if count > 0 and ms > 0 else 0.0


def _per_token(ms: float, count: int) -> float:
    return ms / count if count > 0 else 0.0


def timings(choices: Sequence[ChoiceProgress], now: Optional[float] = None) -> TimingCounts:
    """Timings of a request's choices; finite zeros wherever a denominator is zero.

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
    drafted = sum(c.timings.draft_tokens for c in choices if c.timings is not None)
    accepted = sum(c.timings.draft_accepted for c in choices if c.timings is not None)
    return TimingCounts(
        cache_n=first.cached_tokens,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=_per_token(prompt_ms, prompt_n),
        prompt_per_second=_rate(prompt_n, prompt_ms),
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=_per_token(predicted_ms, intervals),
        predicted_per_second=_rate(intervals, predicted_ms),
        draft_n=drafted if drafted else None,
        draft_n_accepted=accepted if drafted else None,
    )
