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
        self._fill_seconds: deque[float] = deque(maxlen=FILL_TIMES_KEPT)

    def _allocate(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.words, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def track(self, seq_id: int, state: GuidedState) -> None:
        self._states[seq_id] = state

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

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
        index = torch.tensor([i for i, _ in rows], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned host memory: copies without a host sync
            return TokenMask(index.pin_memory().to(self.device, non_blocking=True),
                             bitmask.to(self.device, non_blocking=True), frozenset(held))
        return TokenMask(index, bitmask.clone(), frozenset(held))


def _allows_any(words: np.ndarray, token_ids: Iterable[int]) -> bool:
    """Whether one bitmask row allows any of ``token_ids``."""
    return any(int(words[t // 32]) >> (t % 32) & 1 for t in token_ids)
