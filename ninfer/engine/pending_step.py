"""A launched step whose sampled tokens are still on their way to the host.

Launching a step queues the forward pass, the sampler and a non-blocking copy of the
results into pinned host memory, then records an event. :meth:`PendingStep.result`
waits for that event only, so the host can queue more work (the next decode step)
before it blocks on this one's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ninfer.engine.sampler import SamplerOutput


@dataclass
class SampledRow:
    token_id: int
    logprob: Optional[float] = None
    top_ids: Optional[list[int]] = None
    top_logprobs: Optional[list[float]] = None


class PendingStep:
    """The sampler's output of one launched step; :meth:`result` turns it into rows.

    A verify step's rows come first: for each verify chunk the list of tokens it
    commits (its accepted drafts, then the target's token)."""

    def __init__(self, out: Optional[SamplerOutput], wanted: list[Optional[int]], prompt_rows: dict):
        self._verdict: Optional[list[torch.Tensor]] = None
        self._round_width = 0  # a device round: its packed results' width
        self.round_bank = 0
        self._next_drafts: Optional[list[list[int]]] = None
        #: the step's hidden states, flat (kept only for a draft model; see ModelRunner)
        self.hidden: Optional[torch.Tensor] = None
        #: rows per decode chunk in ``hidden`` (a verify step's width; 0: one row each)
        self.width = 0
        #: int64 [B] on the device: what a follow-up decode step feeds as its input ids
        self.token_ids: Optional[torch.Tensor] = out.token_ids if out is not None else None
        self._wanted = wanted  # per sampled row: how many top log probabilities it asked for
        self._prompt_rows = prompt_rows
        self._host: list[Optional[torch.Tensor]] = []
        self._event = None
        if out is None:
            return
        parts = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
        if out.token_ids.device.type == "cuda":
            # pinned destinations: the copies run behind the step without blocking the host
            self._host = [p.to("cpu", non_blocking=True) if p is not None else None for p in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = parts

    def with_verdict(self, verdict, width: int) -> "PendingStep":
        """Put a verify step's verdict (:class:`ninfer.engine.spec.acceptance.Verdict`) in front."""
        return self._verdict_from([verdict.accepted, verdict.token_ids])

    def with_round(self, packed: torch.Tensor, width: int, bank: int) -> "PendingStep":
        """A device round's results (:meth:`ninfer.engine.spec.device_rounds.DeviceRounds.run`):
        per verify chunk, the drafts kept, ``width`` committed tokens and the next drafts;
        ``bank``: the scratch bank holding its per-position states."""
        self._round_width = width
        self.round_bank = bank
        return self._verdict_from([packed])

    def _verdict_from(self, parts: list[torch.Tensor]) -> "PendingStep":
        if parts[0].device.type == "cuda":
            # queued before anything launched behind this step can overwrite a graph's outputs
            self._verdict = [p.to("cpu", non_blocking=True) for p in parts]
            self._event = torch.cuda.Event()  # recorded after the plain rows' copies too
            self._event.record()
        else:
            self._verdict = parts
        self.token_ids = None  # no plain decode step is launched ahead of a verify step
        return self

    @property
    def is_device_round(self) -> bool:
        """Whether this step is a device round (it settled its state and drafted on the device)."""
        return self._round_width > 0

    @property
    def next_drafts(self) -> Optional[list[list[int]]]:
        """After :meth:`result`, a device round's next drafts per chunk (None otherwise)."""
        return self._next_drafts

    def result(self) -> tuple[list, dict[int, list[SampledRow]]]:
        """Block until the step's tokens are on the host: (one row per sampled chunk, prompt rows)."""
        if self._event is not None:
            self._event.synchronize()
        rows, prompt = self._plain_rows()
        if self._verdict is None:
            return rows, prompt
        if self._round_width:  # one packed [B, 1 + width + k] block
            w = self._round_width
            rows_all = self._verdict[0].tolist()
            accepted, tokens = [r[0] for r in rows_all], [r[1 : 1 + w] for r in rows_all]
            self._next_drafts = [r[1 + w :] for r in rows_all]
        else:
            accepted, tokens = (p.tolist() for p in self._verdict)
        committed = [[SampledRow(t) for t in row[: a + 1]] for a, row in zip(accepted, tokens)]
        return committed + rows, prompt

    def _plain_rows(self) -> tuple[list[SampledRow], dict[int, list[SampledRow]]]:
        if not self._host:
            return [], self._prompt_rows
        token_ids, lps, top_ids, top_lps = self._host
        ids = token_ids.tolist()
        if top_ids is None:
            return [SampledRow(t) for t in ids], self._prompt_rows
        lps, top_ids, top_lps = lps.tolist(), top_ids.tolist(), top_lps.tolist()
        rows = []
        for i, (t, k) in enumerate(zip(ids, self._wanted)):
            rows.append(SampledRow(t) if k is None else SampledRow(t, lps[i], top_ids[i][:k], top_lps[i][:k]))
        return rows, self._prompt_rows


@dataclass
class InFlight:
    """A step launched ahead of the host's bookkeeping (see :mod:`ninfer.engine.decode_ahead`)."""

    sched: object  # SchedulerOutput
    pending: PendingStep
    launched: float  # perf_counter() at launch
