"""Reference short causal depthwise convolution with a carried state (Gated DeltaNet's conv).

Channel ``c`` of token ``t`` becomes ``silu(sum_j weight[c, j] * x[t - (K-1) + j, c])``:
the last tap weighs the token itself, earlier taps the ``K - 1`` tokens before it. Those
earlier tokens may belong to a previous step, so each sequence keeps its last ``K - 1``
inputs in ``states[slot]`` ([K-1, C], time-major); a sequence whose chunk starts at
position 0 sees zeros there instead.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch


def _convolve(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``history`` [..., K-1, C] then ``x`` [..., L, C] -> silu(conv) [..., L, C], float32."""
    full = torch.cat([history.float(), x.float()], dim=-2)
    windows = full.unfold(-2, weight.shape[-1], 1)  # [..., L, C, K]
    return F.silu((windows * weight.float()).sum(dim=-1))


def check_split(split: Sequence[int] | None, channels: int) -> list[int]:
    """The part widths ``split`` asks for (one part, all channels, when None); at most three."""
    if split is None:
        return [channels]
    widths = list(split)
    if not 1 <= len(widths) <= 3 or sum(widths) != channels or min(widths) < 1:
        raise ValueError(f"split {widths} must be 1-3 positive widths adding up to the {channels} channels")
    return widths


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, batch: ForwardBatch,
    split: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Varlen conv of ``x`` [T, C] with ``weight`` [C, K]; updates ``states`` [num_slots, K-1, C].

    Returns [T, C] in ``x``'s dtype; rows past the last sequence come back as zeros. With
    ``split`` (widths adding up to C) it returns those channel groups as separate
    contiguous tensors instead (Gated DeltaNet's q, k and v), as the kernels that follow
    want them.
    """
    widths = check_split(split, x.shape[1])
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    slots = batch.state_slots.tolist()
    keep = weight.shape[-1] - 1
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    starts = list(itertools.accumulate(batch.query_lens_host, initial=0))
    decode = [i for i, n in enumerate(batch.query_lens_host) if n == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=x.device)
        index = torch.tensor([slots[i] for i in decode], device=x.device)
        fresh = torch.tensor([batch.seq_lens_host[i] == 1 for i in decode], device=x.device)
        history = states.index_select(0, index).masked_fill(fresh[:, None, None], 0)
        new = x[rows][:, None]  # [N, 1, C]
        out[rows] = _convolve(history, new, weight)[:, 0].to(x.dtype)
        states.index_copy_(0, index, torch.cat([history, new.to(states.dtype)], dim=1)[:, 1:])
    for i, length in enumerate(batch.query_lens_host):
        if length <= 1:
            continue
        rows = slice(starts[i], starts[i] + length)
        if batch.seq_lens_host[i] == length:
            history = torch.zeros(keep, x.shape[1], dtype=states.dtype, device=x.device)
        else:
            history = states[slots[i]]
        out[rows] = _convolve(history, x[rows], weight).to(x.dtype)
        states[slots[i]] = torch.cat([history, x[rows].to(states.dtype)])[length:]
    if split is None:
        return out
    return tuple(part.contiguous() for part in out.split(widths, dim=-1))
