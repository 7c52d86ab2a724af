"""Continuous batching by token budget: FIFO admission, then one mixed step per call.

There are no separate prefill and decode phases. Each step carries every decode-ready
sequence (one token each) plus chunks of pending prompt from sequences still
prefilling, oldest admission first, until the step's token budget is spent.

For models with recurrent state, admission also needs a free state slot (see
:mod:`ninfer.engine.state_slots`), and finishing a sequence returns it. Prefix reuse
for them rests on state snapshots (:mod:`ninfer.engine.state_cache`): the scheduler
ends a prompt chunk exactly at each snapshot frontier, captures the working slot once
the page ending there is published (:meth:`Scheduler.commit`), and restores the
matched snapshot into a sequence's slot when it is admitted with a cached prefix.

The scheduler owns every sequence it is given, from :meth:`Scheduler.add` to
:meth:`Scheduler.finish`: it and the managers it composes (the block manager, the state
slots) are the only writers of a :class:`~ninfer.engine.sequence.Sequence`'s state. The
engine reports a finished step through :meth:`Scheduler.mark_computed` and each
committed token through :meth:`Scheduler.append_token`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence as Sequence_, Union

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_cache import StateSnapshots, capture_points
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.engine.state_slots import RecurrentState, StateSlots
from ninfer.errors import ContextLengthExceededError


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` pending tokens of ``seq``, starting at its ``num_computed_tokens``."""

    seq: Sequence
    num_tokens: int
    sample: bool  # the chunk reaches the last known token: sample from its last row
    #: speculative drafts after the decode token (a verify row: ``num_tokens`` counts them too)
    drafts: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # verify rows, other decode rows, prefill
    admitted: list[Sequence] = field(default_factory=list)  # newly admitted this step
    num_decode: int = 0  # decode rows, verify rows included
    num_verify: int = 0  # decode rows with drafts (the first ones)
    num_prefill: int = 0
    #: tokens per verify row (drafts, the row's token and padding); 0: the most drafts + 1
    verify_width: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def step_token_budget(prefill_chunk: int, max_concurrency: int, draft_tokens: int = 0) -> int:
    """The most tokens one step computes by default: every decode row with its drafts, plus
    a prefill chunk (also what the KV sizing leaves activation room for)."""
    return prefill_chunk + max_concurrency * (1 + draft_tokens)


class Scheduler:
    """Admission, the step's batch, and every change to the sequences it was given.

    ``state``: a model with recurrent state. Cached KV pages cover only the attention
    layers; resuming after a cached prefix also needs the recurrent state at exactly
    that token, so with prefix reuse on, ``state.snapshots`` must be the block manager's
    frontier index (a match then ends at the deepest page that has a snapshot).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_concurrency: int,
        prefill_chunk: int,
        max_batched_tokens: Optional[int] = None,
        state: Optional[RecurrentState] = None,
        draft_tokens: int = 0,
    ) -> None:
        if max_concurrency < 1 or prefill_chunk < 1:
            raise ValueError("max_concurrency and prefill_chunk must be >= 1")
        if max_batched_tokens is None:
            max_batched_tokens = step_token_budget(prefill_chunk, max_concurrency, draft_tokens)
        # Every decode row must fit, and with fewer decoders each prefill gets a token.
        if max_batched_tokens < max_concurrency:
            raise ValueError(
                f"max_batched_tokens ({max_batched_tokens}) must be at least "
                f"max_concurrency ({max_concurrency})"
            )
        reuse = block_manager.enable_prefix_reuse
        snapshots = state.snapshots if state is not None else None
        if state is not None and reuse and (snapshots is None or block_manager.frontier_index is not snapshots):
            raise ValueError(
                "a model with recurrent state reuses prefixes only through its state snapshots: "
                "make them the block manager's frontier index, or turn prefix reuse off"
            )
        self.block_manager = block_manager
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.max_batched_tokens = max_batched_tokens
        self.draft_tokens = draft_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.state_slots: Optional[StateSlots] = state.slots if state is not None else None
        self.snapshots: Optional[StateSnapshots] = snapshots if reuse else None
        self.scratch: Optional[VerifyScratch] = state.scratch if state is not None else None
        #: seq id -> {frontier: state row} for the frontiers a verify round passed, until committed
        self._round_rows: dict[int, dict[int, int]] = {}
        #: (working slot, verify position) per settled round, copied back in one launch before the next step
        self._settling: list[tuple[int, int]] = []

    def set_prefill_chunk(self, chunk: int) -> None:
        """Compute at most ``chunk`` prompt tokens a step from now on; the step's token budget
        moves by as much, so the decode rows keep their room (the warm-up's continued prompt,
        benchmarks comparing chunk sizes on one engine)."""
        if chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.max_batched_tokens += chunk - self.prefill_chunk
        self.prefill_chunk = chunk

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

    def mark_computed(self, chunk: ScheduledChunk, num_tokens: Optional[int] = None) -> None:
        """The step that ran ``chunk`` is done: its tokens (of a verify row: the first
        ``num_tokens``, the decode token and the drafts kept) are in the KV cache and the
        recurrent state. :meth:`commit` publishes what that completed."""
        chunk.seq.num_computed_tokens += chunk.num_tokens if num_tokens is None else num_tokens

    def settle_verified(self, chunk: ScheduledChunk, kept: int, device_bank: Optional[int] = None) -> None:
        """Before a verify row's tokens are committed: its working state slot is to take
        the state after the first ``kept`` positions (the decode token and the accepted
        drafts; copied for every row of the step at once when the next step is scheduled,
        unless a device round did it itself, writing scratch bank ``device_bank``), and the
        page frontiers those positions pass remember their scratch rows for :meth:`commit`'s
        snapshots."""
        seq = chunk.seq
        if seq.state_slot is None or self.scratch is None:
            return
        if device_bank is None:
            self._settling.append((seq.state_slot, kept - 1))
        bank = device_bank or 0
        start = seq.num_computed_tokens
        self._round_rows[seq.seq_id] = {start + t + 1: self.scratch.row(seq.state_slot, t, bank) for t in range(kept)}

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Commit one output token of ``seq`` (sampled, or forced by a thinking budget or a
        guide); the next step computes it. Its page was reserved at admission."""
        seq.token_ids.append(token_id)

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
        if reason != "abort":  # an aborted step may have left the state half-written
            self.commit(seq)
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        if self.snapshots is not None:
            self.snapshots.finish(seq.seq_id)
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
                if head.num_cached_tokens:  # resume from the snapshot at the matched frontier
                    node = self.block_manager.published_node(head, head.num_cached_tokens)
                    self.snapshots.restore(node, head.state_slot)
            head.status = SequenceStatus.RUNNING
            head.admitted_time = time.monotonic()
            self.running.append(head)
            admitted.append(head)
        return admitted

    def schedule(self, drafts: Optional[Mapping[int, Sequence_[int]]] = None) -> SchedulerOutput:
        """The next step. ``drafts``: speculative tokens per decode-ready sequence (by seq
        id); a sequence with drafts gets a verify row of ``1 + len(drafts)`` tokens, and one
        listed with none joins the verify rows as a row without drafts when others verify
        (the step stays one a verify graph holds), else decodes plainly."""
        if self._settling:  # before anything reads a working slot (or a freed one is reused)
            slots, positions = zip(*self._settling)
            self.scratch.settle(slots, positions)
            self._settling.clear()
        out = SchedulerOutput(admitted=self._admit())
        budget = self.max_batched_tokens
        verify, plain = [], []
        for seq in self.running:
            if seq.is_decode:
                proposed = drafts.get(seq.seq_id) if drafts else None
                chunk = ScheduledChunk(seq, 1 + len(proposed or ()), True, tuple(proposed or ()))
                (plain if proposed is None else verify).append(chunk)
        verify, dropped, out.verify_width = self._fit_verify_width(verify)
        plain = [ScheduledChunk(c.seq, 1, True) for c in dropped] + plain
        budget -= out.verify_width * len(verify) + len(plain)
        out.chunks = verify + plain  # verify rows lead: they are laid out apart from the rest
        out.num_verify = len(verify)
        out.num_decode = len(out.chunks)
        for seq in self.running:
            if budget <= 0:
                break
            pending = seq.num_pending_tokens
            if seq.is_decode or pending <= 0:
                continue
            num_tokens = min(self.prefill_chunk, budget, pending, self._to_next_frontier(seq))
            out.chunks.append(ScheduledChunk(seq, num_tokens, sample=num_tokens == pending))
            budget -= num_tokens
        out.num_prefill = len(out.chunks) - out.num_decode
        return out

    def _fit_verify_width(self, verify: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk], int]:
        """The step's verify rows, the rows that decode plainly instead, and the verify width.

        Verify rows are padded to one width; a row whose pages end before that width would
        reach (its output budget nearly spent) decodes plainly instead, so no row's
        positions, padding included, ever pass its own pages. Rows without drafts verify
        only beside rows with some: left alone, they all decode plainly. Where every row's
        pages hold it, the width is the engine's whole one (1 + its draft count), as the
        verify graphs pad theirs, so a step outside the graphs (verify rows beside a prefill
        chunk) has the one width the warm-up compiled rather than one per draft count a
        request's last tokens leave (each its own kernel variants, compiled while serving)."""
        bs = self.block_manager.block_size

        def holds(c: ScheduledChunk, width: int) -> bool:
            return c.seq.num_computed_tokens + width <= len(c.seq.block_table) * bs

        dropped: list[ScheduledChunk] = []
        width = 0
        while verify:
            most = max(len(c.drafts) for c in verify)
            if not most:
                return [], dropped + verify, 0
            width = 1 + most
            fits = [c for c in verify if holds(c, width)]
            if len(fits) == len(verify):
                break
            dropped += [c for c in verify if c not in fits]
            verify = fits
        if not verify:
            return [], dropped, 0
        full = 1 + self.draft_tokens
        if full > width and all(holds(c, full) for c in verify):
            width = full
        return verify, dropped, width

    # -- snapshots ----------------------------------------------------------------------

    def _to_next_frontier(self, seq: Sequence) -> int:
        """Tokens until the next prompt frontier ``seq`` must stop at for a snapshot."""
        if self.snapshots is None or not seq.commit_prefix_cache:
            return seq.num_pending_tokens
        done = seq.num_computed_tokens
        for frontier in capture_points(seq, self.block_manager.block_size):
            if frontier > done:
                return frontier - done
        return seq.num_pending_tokens

    def commit(self, seq: Sequence) -> None:
        """After a step: publish ``seq``'s completed pages and snapshot its state when its
        frontier is one worth keeping (a prompt frontier, or any page boundary while
        generating, as its rolling snapshot)."""
        self.block_manager.commit(seq)
        rows = self._round_rows.pop(seq.seq_id, None)
        if self.snapshots is None or seq.state_slot is None:
            return
        frontier = seq.num_computed_tokens
        # after a verify round: each frontier it passed, from the scratch row holding that
        # state (a round cut short by a stop has committed fewer tokens than it settled)
        candidates = {frontier: seq.state_slot} if rows is None else {f: r for f, r in rows.items() if f <= frontier}
        for f, row in sorted(candidates.items()):
            kind = self._snapshot_kind(seq, f)
            node = self.block_manager.published_node(seq, f) if kind else None
            if node is not None:
                self.snapshots.capture(node, row, roller=seq.seq_id if kind == "rolling" else None, tokens=f)

    def captures_after(self, sched: SchedulerOutput) -> bool:
        """Whether committing ``sched`` may snapshot a state slot. Nothing that writes the
        slots may be queued behind such a step before it is committed: the snapshot
        must copy the state as of that step's last token."""
        if self.snapshots is None:
            return False
        # a verify row may stop anywhere up to its width: each frontier it could reach counts
        return any(
            self._snapshot_kind(c.seq, c.seq.num_computed_tokens + t) is not None
            for c in sched.chunks for t in range(1 if c.drafts else c.num_tokens, c.num_tokens + 1)
        )

    def _snapshot_kind(self, seq: Sequence, frontier: int) -> Optional[str]:
        """"prompt" or "rolling" when ``seq`` at ``frontier`` computed tokens gets a
        snapshot (provided the page ending there gets published); None otherwise."""
        bs = self.block_manager.block_size
        if frontier <= 0 or frontier % bs or not seq.commit_prefix_cache:
            return None
        prompt = capture_points(seq, bs)
        if frontier in prompt:
            return "prompt"
        # past the prompt frontiers every boundary is at or after the prompt's end
        published = seq.commit_generated or frontier <= seq.num_prompt_tokens
        return "rolling" if frontier > max(prompt, default=0) and published else None
