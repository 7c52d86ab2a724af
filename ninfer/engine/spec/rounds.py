"""The engine's side of speculative rounds: asking for drafts, committing a verdict.

:class:`SpeculativeRounds` is a part of :class:`ninfer.engine.llm_engine.LLMEngine`
(its base class), kept apart because it is one concept: before a step the proposer is
asked for drafts for every decode-ready row that may speculate; after it, a verify
row's kept tokens are committed one by one (a stop among them ends the request there),
its state slot settled, and the proposer told what the target computed. It uses the
engine's request table, scheduler and commit helpers.
"""

from __future__ import annotations

import itertools
from typing import Optional

from loguru import logger

from ninfer.engine.request import GenerationEvent
from ninfer.engine.scheduler import SchedulerOutput
from ninfer.engine.sequence import Sequence
from ninfer.engine.spec.proposer import StepRecord
from ninfer.engine.spec.verify_step import query_lens


class SpeculativeRounds:
    def _drafts(self) -> Optional[dict[int, list[int]]]:
        """This step's proposals, per decode-ready sequence that may speculate: empty for
        one with nothing to propose (one token left in its output budget, a proposer
        that found nothing), which the scheduler then pads into the step's verify rows
        rather than decoding it beside them, a mix that no graph holds."""
        if self.proposer is None:
            return None
        drafts = {}
        for seq in self.scheduler.running:
            if not seq.is_decode or not self._may_speculate(seq):
                continue
            # every kept draft and the target's token must fit the output budget and context
            room = min(seq.max_tokens - seq.num_output_tokens, self.config.max_context - seq.num_tokens) - 1
            limit = min(self.config.draft_tokens, room)
            proposed = self.proposer.propose(seq, limit)[:limit] if limit > 0 else []
            guided = self._requests[seq.request_id].guided
            if guided is not None:  # proposers know nothing of guides: cut where the guide must
                proposed = proposed[: guided.verifiable(proposed)]
            drafts[seq.seq_id] = proposed
        return drafts

    def _draft_probs(self, sched: SchedulerOutput) -> Optional[dict]:
        """The q each verify row's drafts were drawn from, by seq id (absent: proposed greedily)."""
        probs = getattr(self.proposer, "draft_probs", None)
        if probs is None or not sched.num_verify:
            return None
        found = {c.seq.seq_id: probs(c.seq) for c in sched.chunks[: sched.num_verify]}
        return {k: v for k, v in found.items() if v is not None} or None

    def _may_speculate(self, seq: Sequence) -> bool:
        """Rows whose next tokens depend on host-side state each step (a thinking budget,
        log probabilities) decode plainly, as does a request that opted out. Guided rows
        speculate in reasoning and once the guide is active: their drafts are cut where the
        guide must stop them, and each verify row is masked by the guide's state there."""
        tracked = self._requests.get(seq.request_id)
        return (
            tracked is not None
            and tracked.req.speculate
            and (tracked.guided is None or tracked.guided.may_speculate)
            and tracked.budget is None
            and seq.sampling.logprobs is None
            and seq.seq_id not in self._prompt_logprobs
        )

    def _commit_round(self, tracked, chunk, rows: list, now: float, device_round: Optional[int] = None
                      ) -> GenerationEvent:
        """Commit a verify row's accepted drafts and the target's token, in order; a stop
        among them ends the request there and drops the rest. A device round (its scratch
        bank given) settled the row's recurrent state already."""
        seq, out = tracked.seq, tracked.out
        try:
            accepted = len(rows) - 1
            if tracked.guided is not None:  # nothing past an accepted reasoning close marker
                rows = rows[: tracked.guided.committable([r.token_id for r in rows])]
            self.scheduler.settle_verified(chunk, len(rows), device_round)
            tracked.timings.last_token = now
            tracked.timings.record_round(len(chunk.drafts), accepted)
            if chunk.drafts:  # a row padded into another row's verify step proposed nothing
                self.stats.record_round(len(chunk.drafts), accepted)
            text, committed = "", []
            for row in rows:
                self.scheduler.mark_computed(chunk, 1)
                text += self._append(tracked, row.token_id, committed)
                if not out.finished and seq.num_tokens >= self.config.max_context:
                    text += out.finish("length")
                if out.finished:
                    self.scheduler.finish(seq, out.finish_reason)
                    return self._final_event(tracked, text, committed)
            # Only the last committed token can close reasoning (committable); the separator
            # then follows unsampled, as after a plain step.
            text += self._after_sampled(tracked, committed)
            if out.finished:
                self.scheduler.finish(seq, out.finish_reason)
                return self._final_event(tracked, text, committed)
            self.scheduler.commit(seq)
            return self._event(tracked, text, committed)
        except Exception as exc:  # one request's processing failed: fail it alone
            logger.exception("request {} failed while processing its output", seq.request_id)
            return self._error_event(tracked, exc)

    def _tell_proposer(self, sched: SchedulerOutput, starts: list[int], pending) -> None:
        """Hand the proposer what the target computed (a draft model's failure only costs drafts)."""
        hidden = pending.hidden
        q_lens = query_lens(sched, pending.width or None)
        row_starts = [0, *itertools.accumulate(q_lens)][:-1]
        kept = [c.seq.num_computed_tokens - s for c, s in zip(sched.chunks, starts)]
        try:
            self.proposer.after_step(StepRecord(sched.chunks, starts, row_starts, kept, hidden, pending.next_drafts))
        except Exception:
            logger.opt(exception=True).warning("the speculative proposer failed; this step proposes nothing")
