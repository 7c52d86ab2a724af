"""Committing a step's tokens to their requests, and the events that report them.

:class:`TokenCommits` is a part of :class:`ninfer.engine.llm_engine.LLMEngine` (a base
class, as :class:`ninfer.engine.spec.rounds.SpeculativeRounds` is), kept apart because it
is one concept: a sampled token is appended through the scheduler, the tokens committed
unsampled after it follow (a thinking budget's close, a guide's separator), the output
state turns them into text and a finish, and each request's step ends in one
:class:`GenerationEvent` (the last one forgets the request). :class:`Tracked` is the
engine's bookkeeping of one request.
"""

from __future__ import annotations

from typing import Optional

from ninfer.engine.guided_state import GuidedState
from ninfer.engine.output_processor import RequestOutputState
from ninfer.engine.request import EngineRequest, GenerationEvent, RequestTimings
from ninfer.engine.sequence import Sequence
from ninfer.engine.thinking_budget import ThinkingBudgetTracker
from ninfer.errors import NinferError
from ninfer.outputs import PositionLogprobs


class Tracked:
    """Engine-side bookkeeping of one request."""

    __slots__ = ("req", "seq", "out", "timings", "budget", "prompt_logprobs", "guided")

    def __init__(self, req: EngineRequest, seq: Sequence, out: RequestOutputState, guided: Optional[GuidedState]):
        self.req, self.seq, self.out, self.guided = req, seq, out, guided
        self.timings = RequestTimings(arrival=seq.arrival_time, sampling=seq.sampling)
        self.budget = ThinkingBudgetTracker(req.thinking_budget) if req.thinking_budget else None
        # prompt log probabilities gathered over the prefill chunks, until delivered
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = (
            [None] if req.params.prompt_logprobs is not None else None
        )


class TokenCommits:
    """Uses the engine's scheduler, request table, config, stats and guided masks."""

    def _commit_token(self, tracked: Tracked, row, now: float) -> GenerationEvent:
        seq, out = tracked.seq, tracked.out
        # The prompt is fully computed now: its log probabilities go out with this event, once.
        self._prompt_logprobs.pop(seq.seq_id, None)
        prompt_lps, tracked.prompt_logprobs = tracked.prompt_logprobs, None
        if seq.max_tokens == 0:  # prompt processing only
            text = out.finish("length")
            self.scheduler.finish(seq, out.finish_reason)  # frees its slot and pages like any finish
            return self._final_event(tracked, text, [], prompt_logprobs=prompt_lps)
        tracked.timings.first_token = tracked.timings.first_token or now
        tracked.timings.last_token = now
        committed: list[int] = []
        text = self._append(tracked, row.token_id, committed)
        # Tokens committed unsampled: the thinking budget's close, then the separator a
        # guide waits for after reasoning. The next step computes them like a short
        # prefill and samples after them.
        if tracked.budget is not None and not out.finished:
            for forced in tracked.budget.on_token(row.token_id, seq.num_output_tokens - 1):
                text += self._append(tracked, forced, committed)
                if out.finished:
                    break
        text += self._after_sampled(tracked, committed)
        logprobs = None
        if row.logprob is not None:
            logprobs = [out.logprobs(row.token_id, row.logprob, row.top_ids, row.top_logprobs)]
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason)
            return self._final_event(tracked, text, committed, logprobs, prompt_lps)
        return self._event(tracked, text, committed, logprobs, prompt_lps)

    def _after_sampled(self, tracked: Tracked, committed: list[int]) -> str:
        """What follows a step's last sampled token: the separator a guide waits for after
        reasoning closed (committed unsampled), then the context limit; returns the text
        released."""
        out, text = tracked.out, ""
        if tracked.guided is not None and not out.finished:
            for forced in tracked.guided.owed():
                text += self._append(tracked, forced, committed)
                if out.finished:
                    break
        if not out.finished and tracked.seq.num_tokens >= self.config.max_context:
            text += out.finish("length")  # context capacity
        return text

    def _append(self, tracked: Tracked, token_id: int, committed: list[int]) -> str:
        """Commit one output token; returns the text it releases."""
        self.scheduler.append_token(tracked.seq, token_id)
        committed.append(token_id)
        out, guided = tracked.out, tracked.guided
        text = out.on_token(token_id)
        if guided is not None and not out.finished:
            guided.on_token(token_id)  # raises GuideRejectedError, failing this request alone
            if guided.finished:  # the guide allows nothing more
                text += out.finish("stop")
        return text

    def _event(
        self, tracked: Tracked, text: str, token_ids: list[int], logprobs=None, prompt_logprobs=None, **final
    ) -> GenerationEvent:
        seq = tracked.seq
        return GenerationEvent(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            timings=tracked.timings,
            prompt_processed=min(seq.num_computed_tokens, seq.num_prompt_tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **final,
        )

    def _final_event(
        self, tracked: Tracked, text: str, token_ids: list[int], logprobs=None, prompt_logprobs=None
    ) -> GenerationEvent:
        self._forget(tracked)
        budget = tracked.budget
        if budget is not None:  # for the request log: how far it counted, whether it forced the close
            tracked.timings.thinking_counted, tracked.timings.thinking_forced = budget.count, budget.applied
        self.stats.record_finish(tracked.seq)
        return self._event(
            tracked,
            text,
            token_ids,
            logprobs,
            prompt_logprobs,
            finished=True,
            finish_reason=tracked.out.finish_reason,
            stop_reason=tracked.out.stop_reason,
        )

    def _error_event(self, tracked: Tracked, exc: Exception) -> GenerationEvent:
        self.scheduler.abort(tracked.seq)
        self._forget(tracked)
        error = exc if isinstance(exc, NinferError) else NinferError(f"internal error: {type(exc).__name__}")
        return self._event(tracked, "", [], finished=True, finish_reason="error", error=error)

    def _forget(self, tracked: Tracked) -> None:
        self._requests.pop(tracked.seq.request_id, None)
        self._prompt_logprobs.pop(tracked.seq.seq_id, None)
        if self.guided_masks is not None:
            self.guided_masks.forget(tracked.seq.seq_id)

    def fail_all(self, error: NinferError) -> list[GenerationEvent]:
        """End every request with ``error`` (the engine is going away)."""
        return [self._error_event(t, error) for t in list(self._requests.values())]
