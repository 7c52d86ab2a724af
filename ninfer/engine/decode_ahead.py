"""Queueing the next decode step before the host has the current step's tokens.

At low concurrency a decode step takes the device a few milliseconds, and the host's
share of a step (committing tokens, detokenising, stop checks, events, scheduling,
packing the next step's inputs) is a sizeable fraction of that. When the next step is
certain to be the same decode batch, the engine launches it right behind the current
one, its input ids being the tokens the current step samples, read on the device. The
host then does the current step's bookkeeping while the device computes the next.

A step runs ahead only when nothing about it depends on the current step's tokens on
the host:

- the current step decodes every running sequence and nobody waiting could be admitted
  (an admission changes the batch);
- no row is guided (its mask follows the committed tokens), may reach its thinking
  budget with the token in flight (the close it forces would follow that token) or still
  awaits prompt log probabilities. Penalties do not hold a
  step back: their token counts take the host's history plus the step's input tokens,
  which are the newest outputs, counted on the device (``pending_tokens`` of
  :meth:`~ninfer.engine.sampling_metadata.SamplingMetadata.build`);
- committing the current step takes no recurrent-state snapshot (hybrid families, at
  page boundaries): the snapshot must copy the state as of the current step's last
  token, before anything queued behind it moves the state on.

Rows whose current token is certainly their last (max_tokens, context) are left out. A
row that stops for another reason (EOS, a stop string) finishes as usual, and what the
ahead step computed for it is dropped. Its KV write lands past its committed tokens in a
page it held at launch; if that page is freed and handed out meanwhile, its new owner's
writes are queued after the ahead step, so they win.
"""

from __future__ import annotations

from typing import Callable, Optional

from ninfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from ninfer.engine.sequence import Sequence


def plan_ahead(
    sched: SchedulerOutput,
    scheduler: Scheduler,
    needs_host_tokens: Callable[[Sequence], bool],
    max_context: int,
) -> tuple[Optional[SchedulerOutput], list[int]]:
    """The decode step to launch behind ``sched`` and, per chunk of it, the index of the
    sampled row of ``sched`` that feeds its input id; (None, []) when none may run ahead."""
    chunks = sched.chunks
    if sched.num_prefill or sched.num_decode != len(chunks) or len(chunks) != scheduler.num_running:
        return None, []
    if scheduler.num_waiting and scheduler.num_running < scheduler.max_concurrency:
        return None, []
    if any(needs_host_tokens(c.seq) for c in chunks) or scheduler.captures_after(sched):
        return None, []
    ahead: list[ScheduledChunk] = []
    rows: list[int] = []
    for row, chunk in enumerate(chunks):
        seq = chunk.seq
        # after the current token: one more output and one more context position
        if seq.num_output_tokens + 1 >= seq.max_tokens or seq.num_tokens + 1 >= max_context:
            continue
        ahead.append(ScheduledChunk(seq, 1, sample=True))
        rows.append(row)
    if not ahead:
        return None, []
    return SchedulerOutput(chunks=ahead, num_decode=len(ahead)), rows
