"""Continuous batching by token budget: FIFO admission, then one mixed step per call.

There are no separate prefill and decode phases. Each step carries every decode-ready
sequence (one token each) plus chunks of pending prompt from sequences still
prefilling, oldest admission first, until the step's token budget is spent.

For models with recurrent state, admission also needs a free state slot (see
:mod:`ninfer.engine.state_slots`), and finishing a sequence returns it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Union

from loguru import logger

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_slots import StateSlots
from ninfer.errors import ContextLengthExceededError


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` pending tokens of ``seq``, starting at its ``num_computed_tokens``."""

    seq: Sequence
    num_tokens: int
    sample: bool  # the chunk reaches the last known token: sample from its last row


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode rows first
    admitted: list[Sequence] = field(default_factory=list)  # newly admitted this step
    num_decode: int = 0
    num_prefill: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_concurrency: int,
        prefill_chunk: int,
        max_batched_tokens: Optional[int] = None,
        state_slots: Optional[StateSlots] = None,
    ) -> None:
        if max_concurrency < 1 or prefill_chunk < 1:
            raise ValueError("max_concurrency and prefill_chunk must be >= 1")
        if max_batched_tokens is None:
            max_batched_tokens = prefill_chunk + max_concurrency
        # Every decode row must fit, and with fewer decoders each prefill gets a token.
        if max_batched_tokens < max_concurrency:
            raise ValueError(
                f"max_batched_tokens ({max_batched_tokens}) must be at least "
                f"max_concurrency ({max_concurrency})"
            )
        self.block_manager = block_manager
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.state_slots: Optional[StateSlots] = None
        if state_slots is not None:
            self.attach_state_slots(state_slots)

    def attach_state_slots(self, slots: StateSlots) -> None:
        """Serve a model with recurrent state: one slot per admitted sequence.

        Prefix reuse is switched off with it. Cached KV pages cover only the attention
        layers; resuming after a cached prefix would also need the recurrent state at
        exactly that token, which nothing snapshots yet, so reuse could not stay exact.
        """
        if self.running:
            raise RuntimeError("state slots must be attached before any request is admitted")
        self.state_slots = slots
        if self.block_manager.enable_prefix_reuse:
            self.block_manager.enable_prefix_reuse = False
            logger.info("prefix reuse is off for this model family: its recurrent state has no snapshots yet")

    # -- gauges ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_decode_ready(self) -> int:
        return sum(1 for seq in self.running if seq.is_decode)

    @property
    def num_prefilling(self) -> int:
        return self.num_running - self.num_decode_ready

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- request lifecycle --------------------------------------------------------------

    def fits_ever(self, seq: Sequence) -> bool:
        return self.block_manager.fits_ever(seq)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every earlier request."""
        if not self.fits_ever(seq):
            bm = self.block_manager
            raise ContextLengthExceededError(
                f"the request needs {bm.blocks_needed(seq)} KV pages of {bm.block_size} tokens "
                f"(prompt plus max_tokens), but the pool holds only {bm.num_blocks}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, target: Union[str, Sequence]) -> Optional[Sequence]:
        """Drop a waiting or running request (by request id or object) and free its pages."""
        seq = self._find(target)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and return its pages; a second call changes nothing."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _find(self, target: Union[str, Sequence]) -> Optional[Sequence]:
        for seq in (*self.running, *self.waiting):
            if seq is target or seq.request_id == target:
                return seq
        return None

    # -- the step -------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_concurrency:
            head = self.waiting[0]
            if self.state_slots is not None and not self.state_slots.can_take():
                break  # strict FIFO, as for pages below
            if not self.block_manager.can_allocate(head):
                break  # strict FIFO: nobody overtakes a head that is waiting for pages
            self.waiting.popleft()
            self.block_manager.allocate(head)
            if self.state_slots is not None:
                self.state_slots.take(head)
            head.status = SequenceStatus.RUNNING
            head.admitted_time = time.monotonic()
            self.running.append(head)
            admitted.append(head)
        return admitted

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(admitted=self._admit())
        budget = self.max_batched_tokens
        for seq in self.running:
            if seq.is_decode:
                out.chunks.append(ScheduledChunk(seq, 1, sample=True))
                budget -= 1
        out.num_decode = len(out.chunks)
        for seq in self.running:
            if budget <= 0:
                break
            pending = seq.num_pending_tokens
            if seq.is_decode or pending <= 0:
                continue
            num_tokens = min(self.prefill_chunk, budget, pending)
            out.chunks.append(ScheduledChunk(seq, num_tokens, sample=num_tokens == pending))
            budget -= num_tokens
        out.num_prefill = len(out.chunks) - out.num_decode
        return out
