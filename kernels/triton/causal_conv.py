"""Gated DeltaNet's causal depthwise conv in Triton, reading and updating per-slot state.

One program owns one sequence and a block of channels: it walks the sequence's tokens
in order, reading each tap either from the step's input rows or, before the chunk's
first token, from the slot's stored history; then it writes the slot's new history
(the last ``K - 1`` inputs). Decode rows and prefill chunks share the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch

BLOCK_C = 128


@triton.jit
def _causal_conv_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, starts_ptr, seq_lens_ptr, slots_ptr,
    channels, stride_x, stride_w, stride_slot, stride_hist, stride_out,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < channels
    # int64 row indices: the loop variable then indexes large tensors without overflow
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    cached = tl.load(seq_lens_ptr + seq) - (end - start)  # tokens before this chunk: 0 starts fresh
    state = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_slot
    taps = tl.arange(0, KP)
    # (the flag is broadcast through a vector: Triton's interpreter rejects scalar-and-block masks)
    has_history = (taps * 0 + cached) > 0
    tap_ok = taps < K
    w = tl.load(w_ptr + cols[:, None] * stride_w + taps[None, :], mask=col_ok[:, None] & tap_ok[None, :], other=0.0)
    w = w.to(tl.float32)
    for t in range(start, end):
        pos = t - (K - 1) + taps  # input row of each tap; rows before `start` live in the state
        in_x = pos >= start
        hist = K - 1 + pos - start
        xv = tl.load(
            x_ptr + pos[None, :] * stride_x + cols[:, None],
            mask=col_ok[:, None] & (tap_ok & in_x)[None, :], other=0.0,
        )
        sv = tl.load(
            state + hist[None, :] * stride_hist + cols[:, None],
            mask=col_ok[:, None] & (tap_ok & ~in_x & (hist >= 0) & has_history)[None, :], other=0.0,
        )
        acc = tl.sum((xv.to(tl.float32) + sv.to(tl.float32)) * w, axis=1)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)
    # new history: the last K - 1 inputs, some possibly still from the old history
    rows = tl.arange(0, KP)
    row_ok = rows < K - 1
    pos = end - (K - 1) + rows
    in_x = pos >= start
    hist = K - 1 + pos - start
    xv = tl.load(
        x_ptr + pos[None, :] * stride_x + cols[:, None],
        mask=col_ok[:, None] & (row_ok & in_x)[None, :], other=0.0,
    )
    sv = tl.load(
        state + hist[None, :] * stride_hist + cols[:, None],
        mask=col_ok[:, None] & (row_ok & ~in_x & has_history)[None, :], other=0.0,
    )
    tl.debug_barrier()  # every read of the old history happens before it is overwritten
    new = xv.to(state_ptr.dtype.element_ty) + sv
    tl.store(state + rows[None, :] * stride_hist + cols[:, None], new, mask=col_ok[:, None] & row_ok[None, :])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """Same contract as :func:`ninfer_kernels.causal_conv.causal_conv1d`."""
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.reshape(weight.shape[0], -1)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    channels, k = weight.shape
    num_seqs = batch.num_seqs
    if num_seqs == 0:
        return out
    grid = (num_seqs, triton.cdiv(channels, BLOCK_C))
    _causal_conv_kernel[grid](
        x, weight, states, out, batch.query_start, batch.seq_lens, batch.state_slots,
        channels, x.stride(0), weight.stride(0), states.stride(0), states.stride(1), out.stride(0),
        K=k, KP=triton.next_power_of_2(k), BLOCK=BLOCK_C, num_warps=4,
    )
    return out
