"""Chat completion chunks for server-sent events.

Order: one assistant-role chunk per choice; with ``return_progress`` prompt-progress
chunks up to ``processed == total``; reasoning, content and tool-call deltas (each in
its own chunk); a finish chunk per choice; with ``include_usage`` a chunk with empty
choices and the usage; the terminal timings ride on the last of these. The caller
frames each payload as an SSE event and ends with ``[DONE]``.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence

from ninfer.frontend.choice_output import ChoiceEvent, ChoiceProgress
from ninfer.frontend.output_split import Delta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from ninfer_plugins.protocols.openai_chat.choice import finish_reason, timings, usage, wire_logprobs
from ninfer_plugins.protocols.openai_chat.schema import (
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    FunctionDelta,
    PromptProgress,
    TokenLogprob,
    ToolCallDelta,
    encoder,
)
from ninfer_plugins.protocols.openai_chat.schema import Delta as WireDelta


def wire_delta(d: Delta) -> WireDelta | None:
    """A splitter delta in OpenAI's delta shape (None for deltas with no wire form)."""
    if isinstance(d, TextDelta):
        return WireDelta(content=d.text)
    if isinstance(d, ReasoningDelta):
        return WireDelta(reasoning_content=d.text)
    if isinstance(d, ToolCallStart):
        call = ToolCallDelta(index=d.index, id=d.id, type="function", function=FunctionDelta(name=d.name, arguments=""))
        return WireDelta(tool_calls=[call])
    if isinstance(d, ToolCallArgs):
        return WireDelta(tool_calls=[ToolCallDelta(index=d.index, function=FunctionDelta(arguments=d.fragment))])
    return None  # ToolCallEnd: the fragments already carried the arguments


class ChunkStream:
    """Builds the chunk sequence of one streamed request."""

    def __init__(self, request_id: str, created: int, model: str, states: Sequence[ChoiceProgress], tokenizer: Any,
                 *, want_logprobs: bool, include_usage: bool, timings_per_token: bool, return_progress: bool):
        self.rid, self.created, self.model = request_id, created, model
        self.states = states
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.timings_per_token = timings_per_token
        self.return_progress = return_progress
        self._pending_logprobs: dict[int, list[TokenLogprob]] = {s.index: [] for s in states}
        self._progress = -1  # last processed count reported
        self._output_started = False

    def _chunk(self, choices: list[ChunkChoice], **extra) -> str:
        usage_field = {"usage": None} if self.include_usage and "usage" not in extra else {}
        chunk = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices,
                                    **usage_field, **extra)
        return encoder.encode(chunk).decode()

    def _logprobs(self, index: int) -> ChoiceLogprobs | None:
        if not self.want_logprobs:
            return None
        pending, self._pending_logprobs[index] = self._pending_logprobs[index], []
        return ChoiceLogprobs(content=pending)

    def opening(self) -> list[str]:
        return [self._chunk([ChunkChoice(s.index, WireDelta(role="assistant", content=""))]) for s in self.states]

    def progress(self, state: ChoiceProgress, final: bool = False) -> list[str]:
        """A prompt-progress chunk when the count moved (the first choice's prompt only)."""
        if not self.return_progress or state is not self.states[0] or self._output_started:
            return []
        processed = state.prompt_tokens if final else state.prompt_processed
        if processed <= self._progress:
            return []
        self._progress = processed
        t = state.timings
        elapsed = time.monotonic() - t.admitted if t is not None and t.admitted is not None else 0.0
        progress = PromptProgress(total=state.prompt_tokens, cache=state.cached_tokens, processed=processed,
                                  time_ms=int(elapsed * 1000))
        return [self._chunk([], prompt_progress=progress)]

    def on_event(self, event: ChoiceEvent) -> list[str]:
        """Chunks for one event of one choice (finish chunks included)."""
        state, deltas = event.choice, event.deltas
        out = self.progress(state)
        if event.token_ids or event.finished:
            out += self.progress(state, final=True)  # the prompt is done before any output
            self._output_started = True
        if self.want_logprobs:
            self._pending_logprobs[state.index] += wire_logprobs(self.tokenizer, event.logprobs)
        for d in deltas:
            wire = wire_delta(d)
            if wire is None:
                continue
            extra = {"timings": timings(self.states)} if self.timings_per_token else {}
            out.append(self._chunk([ChunkChoice(state.index, wire, logprobs=self._logprobs(state.index))], **extra))
        if event.finished:
            out.append(self._finish(state))
        return out

    def _finish(self, state: ChoiceProgress) -> str:
        last = not self.include_usage and all(s.finished_at is not None for s in self.states)
        extra = {"timings": timings(self.states)} if last else {}
        choice = ChunkChoice(state.index, WireDelta(), finish_reason=finish_reason(state),
                             logprobs=self._logprobs(state.index))
        return self._chunk([choice], **extra)

    def closing(self) -> list[str]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage=usage(self.states), timings=timings(self.states))]


async def chunks(stream: ChunkStream, events: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
    """Every JSON payload of the stream, in order (without the ``[DONE]`` sentinel).

    Nothing is produced before the engine's first event, so a request refused at
    admission still gets a plain HTTP error.
    """
    opened = False
    async for event in events:
        if not opened:
            opened = True
            for payload in stream.opening():
                yield payload
        for payload in stream.on_event(event):
            yield payload
    for payload in stream.closing():
        yield payload
