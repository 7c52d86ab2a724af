"""Per-step device tensors that describe how each row of a batch is sampled.

Built once per step from plain Python values. Anything no row of the batch needs stays
``None`` so the sampler skips that work: a batch of plain temperature sampling never
touches penalty, bias or ranking tensors.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import attrs
import numpy as np
import torch

from ninfer.engine.defaults import ResolvedSampling

#: a top-p threshold no cumulative probability reaches: rows with it are never cut
TOP_P_OFF = 2.0


@attrs.frozen(eq=False)
class TokenMask:
    """The tokens guided rows may take this step, and the rows that may not stop yet
    (see :mod:`ninfer.engine.guided_masks`)."""

    #: int64 [G]: which rows of the batch are masked by their guide (None: no row is)
    rows: Optional[torch.Tensor]
    #: int32 [G, ceil(V / 32)]: bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed
    bitmask: Optional[torch.Tensor]
    #: batch rows whose guide cannot end yet (still in reasoning, or not accepting):
    #: their stop tokens are banned
    hold_stops: frozenset[int] = frozenset()


@attrs.frozen(eq=False)
class SamplingMetadata:
    """Row settings as ``[B]``/``[B, 1]`` tensors on the sampling device.

    Greedy rows carry neutral placeholders in the random-sampling tensors (temperature 1,
    top-k 1, top-p off) so they never widen the ranking work; their token is the argmax.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    #: bool [B]; None when no row is greedy or every row is
    greedy_mask: Optional[torch.Tensor] = None
    #: float32 [B, 1]; None when every random row uses temperature 1 (or all are greedy)
    temperature: Optional[torch.Tensor] = None
    #: float32 [B, 1] natural log of min_p (-inf = off); None when no random row uses it
    log_min_p: Optional[torch.Tensor] = None
    #: int64 [B, 1] tokens kept per row (vocab size = off); None when no random row caps
    top_k: Optional[torch.Tensor] = None
    #: float32 [B, 1] (TOP_P_OFF = off); None when no random row uses top-p
    top_p: Optional[torch.Tensor] = None
    #: how many ranked candidates the filters need: the largest top-k when every random
    #: row caps it, otherwise the whole vocabulary
    candidate_width: int = 0
    #: int64 [B] request seeds wrapped to signed 64 bits, and output positions
    seeds: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    #: float32 [B, 1] and bool [B, V] (token seen in prompt or output)
    repetition_penalty: Optional[torch.Tensor] = None
    repetition_mask: Optional[torch.Tensor] = None
    #: float32 [B, 1] each, and float32 [B, V] occurrence counts of output tokens
    presence_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    output_counts: Optional[torch.Tensor] = None
    #: sparse logit bias: int64 [N] rows and token ids, float32 [N] values
    bias_rows: Optional[torch.Tensor] = None
    bias_token_ids: Optional[torch.Tensor] = None
    bias_values: Optional[torch.Tensor] = None
    #: the most top log probabilities any row asked for; None when no row wants logprobs
    max_num_logprobs: Optional[int] = None
    #: guided decoding's allowed tokens; None when no row is masked by its guide this step
    token_mask: Optional[TokenMask] = None
    #: int64 [N] flat indices (row * V + token) of stop tokens no row may take yet: before
    #: its min_tokens, or while its guide cannot end; None when there are none
    banned_stops: Optional[torch.Tensor] = None

    @classmethod
    def build(
        cls,
        rows: Sequence[ResolvedSampling],
        output_positions: Sequence[int],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        token_mask: Optional[TokenMask] = None,
        pending_tokens: Optional[torch.Tensor] = None,
    ) -> SamplingMetadata:
        """``output_positions[i]`` is the index, within row i's output, of the token sampled now.
        ``pending_tokens`` (int64 [B] on the device): each row's newest output token, which
        the host does not have yet (a decode step launched ahead); the penalties count it
        after the histories, on the device."""
        n = len(rows)
        if not (len(output_positions) == len(output_token_ids) == len(prompt_token_ids) == n):
            raise ValueError("every per-row list must have one entry per row")
        device = torch.device(device)
        fields: dict = {}
        greedy = [r.greedy for r in rows]
        all_greedy = all(greedy)
        if any(greedy) and not all_greedy:
            fields["greedy_mask"] = to_device(greedy, torch.bool, device)
        if not all_greedy:
            fields.update(_random_fields(rows, greedy, output_positions, vocab_size, device))
        fields.update(_penalty_fields(rows, output_token_ids, prompt_token_ids, vocab_size, device, pending_tokens))
        fields.update(_bias_fields(rows, device))
        held = token_mask.hold_stops if token_mask is not None else frozenset()
        fields.update(_stop_ban_fields(rows, output_positions, held, vocab_size, device))
        wanted = [r.logprobs for r in rows if r.logprobs is not None]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            max_num_logprobs=max(wanted) if wanted else None,
            token_mask=token_mask if token_mask is not None and token_mask.rows is not None else None,
            **fields,
        )


def _random_fields(
    rows: Sequence[ResolvedSampling],
    greedy: list[bool],
    positions: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> dict:
    random_rows = [r for r, g in zip(rows, greedy) if not g]
    out: dict = {
        "seeds": to_device([_wrap_int64(r.seed) for r in rows], torch.int64, device),
        "positions": to_device(list(positions), torch.int64, device),
        "candidate_width": vocab_size,
    }
    if any(r.temperature != 1.0 for r in random_rows):
        temps = [1.0 if g else r.temperature for r, g in zip(rows, greedy)]
        out["temperature"] = _column(temps, torch.float32, device)
    if any(r.min_p > 0 for r in random_rows):
        logs = [math.log(r.min_p) if r.min_p > 0 and not g else -math.inf for r, g in zip(rows, greedy)]
        out["log_min_p"] = _column(logs, torch.float32, device)
    capped = [0 < r.top_k < vocab_size for r in random_rows]
    if any(capped):
        ks = [1 if g else (r.top_k if 0 < r.top_k < vocab_size else vocab_size) for r, g in zip(rows, greedy)]
        out["top_k"] = _column(ks, torch.int64, device)
        if all(capped):
            out["candidate_width"] = max(r.top_k for r in random_rows)
    if any(r.top_p < 1.0 for r in random_rows):
        ps = [TOP_P_OFF if g or r.top_p >= 1.0 else r.top_p for r, g in zip(rows, greedy)]
        out["top_p"] = _column(ps, torch.float32, device)
    return out


def _penalty_fields(
    rows: Sequence[ResolvedSampling],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
    pending: Optional[torch.Tensor] = None,
) -> dict:
    out: dict = {}
    if any(r.repetition_penalty != 1.0 for r in rows):
        out["repetition_penalty"] = _column([r.repetition_penalty for r in rows], torch.float32, device)
        seen = _row_counts(list(zip(prompt_token_ids, output_token_ids)), vocab_size, device)
        out["repetition_mask"] = _with_pending(seen, pending) > 0
    if any(r.presence_penalty != 0 or r.frequency_penalty != 0 for r in rows):
        out["presence_penalty"] = _column([r.presence_penalty for r in rows], torch.float32, device)
        out["frequency_penalty"] = _column([r.frequency_penalty for r in rows], torch.float32, device)
        histories = [((), o) for o in output_token_ids]
        out["output_counts"] = _with_pending(_row_counts(histories, vocab_size, device), pending)
    return out


def _row_counts(histories: list[tuple], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [B, V]: each row's token counts over its history, given as parts (prompt,
    output). Rows whose parts are the same objects (a verify step repeats each request's
    history for its k + 1 rows) are counted once and their line repeated."""
    first: dict = {}
    index = [first.setdefault(tuple(map(id, parts)), len(first)) for parts in histories]
    distinct: list = [None] * len(first)
    for parts, i in zip(histories, index):
        distinct[i] = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])
    counts = _token_counts(distinct, vocab_size, device)
    return counts if len(distinct) == len(index) else counts[to_device(index, torch.int64, device)]


def _with_pending(counts: torch.Tensor, pending: Optional[torch.Tensor]) -> torch.Tensor:
    """``counts`` [B, V] with each row's pending token (int64 [B]) counted once more."""
    if pending is None:
        return counts
    return counts.scatter_add_(1, pending.view(-1, 1), torch.ones(counts.shape[0], 1, device=counts.device))


def _bias_fields(rows: Sequence[ResolvedSampling], device: torch.device) -> dict:
    entries = [(i, tok, bias) for i, r in enumerate(rows) for tok, bias in r.logit_bias.items()]
    if not entries:
        return {}
    row_ids, token_ids, values = zip(*entries)
    return {
        "bias_rows": to_device(list(row_ids), torch.int64, device),
        "bias_token_ids": to_device(list(token_ids), torch.int64, device),
        "bias_values": to_device(list(values), torch.float32, device),
    }


def _stop_ban_fields(
    rows: Sequence[ResolvedSampling],
    positions: Sequence[int],
    held: frozenset[int],
    vocab_size: int,
    device: torch.device,
) -> dict:
    """The stop tokens each row may not sample now: the request would end too early."""
    flat = [
        i * vocab_size + t
        for i, (r, pos) in enumerate(zip(rows, positions))
        if r.stop_token_ids and (pos < r.min_tokens or i in held)
        for t in r.stop_token_ids
        if 0 <= t < vocab_size  # an id outside the vocabulary is never sampled anyway
    ]
    return {"banned_stops": to_device(flat, torch.int64, device)} if flat else {}


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [B, V]: how often each token id occurs in each row's list (lists or int64
    arrays: ``Sequence.output_array`` hands arrays, which copy at memory speed)."""
    width = max((len(t) for t in token_lists), default=0)
    # pad with an extra id one past the vocabulary, counted in a column that is dropped
    padded = np.full((len(token_lists), width), vocab_size, dtype=np.int64)
    for row, tokens in zip(padded, token_lists):
        row[: len(tokens)] = tokens
    index = _array_to_device(padded, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def _array_to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """:func:`to_device` for a numpy array."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(values, dtype, device).unsqueeze(1)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy host values to ``device`` without making the host wait for queued GPU work."""
    if device.type == "cuda":  # built in pinned memory: the copy is queued, not waited for
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _wrap_int64(value: int) -> int:
    """Map any integer onto the signed 64-bit range (requests may send unsigned seeds)."""
    return (value + 2**63) % 2**64 - 2**63
