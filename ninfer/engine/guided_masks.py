"""Per-step token masks for the guided rows of a batch.

The backend fills one preallocated int32 bitmask (a row per guided sequence) from the
matchers' state after the last commit; on CUDA hosts the rows are filled in parallel
on the backend's threads, on CPU-only hosts one after another on the engine thread
(torch's worker threads keep the cores busy there, and a measured run was several
times faster that way). The model
runner asks for it before the step's logits are computed: on CUDA the forward pass and
the logits are still running on the device while the host fills the masks, so the
fill costs no device time. The filled rows travel to the device as they are; the
sampler unpacks the bits there.

In a speculative verify step a guided row's ``width`` verify rows are masked too: row
``j`` by the guide's state after the row's drafts ``0..j-1``, exactly what the plain path
would mask there had those drafts been committed. The matchers are advanced through
the drafts on the host (depth by depth, so each depth's rows still fill in one call),
and rolled back afterwards. Rows still reasoning hold their stops at every position
(their drafts end with the close marker, and nothing sampled after an accepted marker
is committed: :meth:`GuidedState.committable`).

A guided request may not stop while its guide is pending: rows still reasoning (the
guide has not started) and rows whose mask does not yet allow end-of-sequence (the
guide cannot end) are listed in the mask's ``hold_stops``, and the sampler bans their
stop tokens, their own ``stop_token_ids`` included.

Filling on a Python worker thread instead (to overlap a CPU forward pass as well) lost
milliseconds per step in handoffs waiting for the GIL's switch interval, far more than
a fill costs.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

import numpy as np
import torch

from ninfer.engine.guided_state import GuidedState
from ninfer.engine.sampling_metadata import TokenMask
from ninfer.guided.backend import GuideCompiler


#: mask fills whose duration is kept (for ninfer-bench's guided figure): minutes of steps
FILL_TIMES_KEPT = 4096


class GuidedMasks:
    """The guided sequences of an engine, by sequence id, and their step masks."""

    def __init__(self, compiler: GuideCompiler, vocab_size: int, device: torch.device, rows: int = 1):
        self.compiler, self.device = compiler, torch.device(device)
        self.words = (vocab_size + 31) // 32
        self._states: dict[int, GuidedState] = {}
        self._bitmask = self._allocate(max(rows, 1))
        # a verify step's masks: the plain rows of the same step fill the buffer above
        # while these may still be on their way to the device
        self._verify_bitmask = self._allocate(1)
        self._fill_seconds: deque[float] = deque(maxlen=FILL_TIMES_KEPT)

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.words, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def track(self, seq_id: int, state: GuidedState) -> None:
        self._states[seq_id] = state

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def guides(self, seq_id: int) -> bool:
        """Whether sequence ``seq_id`` is guided (its rows are masked)."""
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def take_fill_seconds(self) -> list[float]:
        """How long each :meth:`masks` call took since the last call (the latest
        ``FILL_TIMES_KEPT``): the host's share of guided decoding."""
        seconds = list(self._fill_seconds)
        self._fill_seconds.clear()
        return seconds

    def masks(self, seq_ids: Iterable[int]) -> Optional[TokenMask]:
        """The allowed tokens of the sampled rows (their sequence ids, in batch order), and
        the rows that may not stop yet; None when no row is guided this step."""
        started = time.perf_counter()
        try:
            return self._masks(seq_ids)
        finally:
            self._fill_seconds.append(time.perf_counter() - started)

    def _masks(self, seq_ids: Iterable[int]) -> Optional[TokenMask]:
        guided = [(i, st) for i, sid in enumerate(seq_ids) if (st := self._states.get(sid)) is not None]
        # Reasoning rows are not masked, but ending there would leave the guide unstarted.
        held = {i for i, st in guided if st.before_answer}
        rows = [(i, st) for i, st in guided if st.masked]
        if not rows:
            return TokenMask(None, None, frozenset(held)) if held else None
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = self._allocate(len(rows))
        # The previous step's copy out of this buffer ended at that step's host sync.
        bitmask = self._bitmask[: len(rows)]
        self.compiler.fill_bitmask([st.matcher for _, st in rows], bitmask, parallel=self.device.type == "cuda")
        words = bitmask.numpy().view(np.uint32)
        # The backend allows end-of-sequence exactly once a guide may end; until then the
        # request's other stop tokens wait as well.
        held.update(i for j, (i, st) in enumerate(rows) if st.end_ids and not _allows_any(words[j], st.end_ids))
        for j, (_, st) in enumerate(rows):
            if st.extra_token is not None:
                words[j, st.extra_token // 32] |= np.uint32(1 << (st.extra_token % 32))
        return self._token_mask([i for i, _ in rows], bitmask, held)

    def verify_masks(self, chunks, width: int) -> Optional[TokenMask]:
        """The masks of a verify step's rows (``width`` per chunk, chunk-major; the chunks'
        ``drafts`` cut by :meth:`GuidedState.verifiable`); None when no chunk is guided."""
        started = time.perf_counter()
        try:
            return self._verify_masks(chunks, width)
        finally:
            self._fill_seconds.append(time.perf_counter() - started)

    def _verify_masks(self, chunks, width: int) -> Optional[TokenMask]:
        guided = [(b * width, st, c.drafts) for b, c in enumerate(chunks)
                  if (st := self._states.get(c.seq.seq_id)) is not None]
        for _, st, _ in guided:
            if not st.may_speculate:
                raise RuntimeError(f"a guided row in phase {st.phase.value} cannot be verified")
        held = {first + j for first, st, _ in guided if st.before_answer for j in range(width)}
        every = [_Walk(first, st, drafts) for first, st, drafts in guided if st.masked]
        if not every:
            return TokenMask(None, None, frozenset(held)) if held else None
        needed = sum(len(w.drafts) + 1 for w in every)
        if needed > self._verify_bitmask.shape[0]:
            self._verify_bitmask = self._allocate(needed)
        rows: list[int] = []
        walks = every
        try:
            for depth in range(width):  # every walk here has consumed ``depth`` drafts
                walks = [w for w in walks if w.consumed == depth]
                if not walks:
                    break
                bitmask = self._verify_bitmask[len(rows) : len(rows) + len(walks)]
                self.compiler.fill_bitmask([w.state.matcher for w in walks], bitmask,
                                           parallel=self.device.type == "cuda")
                words = bitmask.numpy().view(np.uint32)
                for j, w in enumerate(walks):
                    rows.append(w.first + depth)
                    if w.state.end_ids and not _allows_any(words[j], w.state.end_ids):
                        held.add(w.first + depth)
                    w.advance()
        finally:
            for w in every:
                w.state.matcher.rollback(w.consumed)
        return self._token_mask(rows, self._verify_bitmask[: len(rows)], held)

    def _token_mask(self, rows: list[int], bitmask: torch.Tensor, held: set[int]) -> TokenMask:
        index = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":  # pinned host memory: copies without a host sync
            return TokenMask(index.pin_memory().to(self.device, non_blocking=True),
                             bitmask.to(self.device, non_blocking=True), frozenset(held))
        return TokenMask(index, bitmask.clone(), frozenset(held))


def _allows_any(words: np.ndarray, token_ids: Iterable[int]) -> bool:
    """Whether one bitmask row allows any of ``token_ids``."""
    return any(int(words[t // 32]) >> (t % 32) & 1 for t in token_ids)


class _Walk:
    """One guided verify row's matcher, advanced through its drafts one depth at a time."""

    def __init__(self, first: int, state: GuidedState, drafts):
        self.first, self.state, self.drafts = first, state, list(drafts)
        self.consumed = 0
        # Drafts come cut where the round must stop (GuidedState.verifiable); a draft the
        # matcher still cannot take is never accepted, so the rows after it are never
        # committed and stay unmasked.
        self._valid = state.matcher.validate_tokens(self.drafts)

    def advance(self) -> None:
        """Consume the next draft, if the rows after it can be reached: not past the last
        draft, a refused one, end-of-sequence or the guide's end (all end the round)."""
        matcher, i = self.state.matcher, self.consumed
        if i < self._valid and self.drafts[i] not in self.state.end_ids and not matcher.is_stopped():
            matcher.consume_token(self.drafts[i])
            self.consumed += 1
