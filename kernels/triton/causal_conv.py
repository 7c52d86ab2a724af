"""Gated DeltaNet's causal depthwise conv in Triton, reading and updating per-slot state.

One program owns a block of ``BLOCK_T`` tokens of one sequence and ``BLOCK_C`` channels,
so a long prefill chunk spreads over many programs instead of one program walking its
8k tokens in order. Each tap of a token comes from the step's input rows or, for
positions before the chunk, from the slot's stored history (zeros for a chunk starting
at position 0, or for a negative slot: graph padding, which reads and writes no state).

Token blocks are aligned to each sequence's first row, on one flat grid axis: sequence
``i`` owns blocks from ``(query_start[i] + i * (BLOCK_T - 1)) // BLOCK_T`` on, which is
at least ``cdiv(len_i, BLOCK_T)`` blocks (the spare ones exit at once) and is computed in
the kernel by a binary search over ``query_start``. The grid then needs only host shapes,
and a batch of one 8k chunk and many decode rows launches about one program per block of
work, where a (sequence, token block) grid would launch num_seqs x the chunk's blocks.

History, race-free: only a sequence's first token block reads the old history (later
blocks' taps all lie inside the chunk, since ``BLOCK_T >= K - 1``), so that same program
writes the new one: the last ``K - 1`` inputs, read from the chunk's last rows (``x`` is
never written) and, for a chunk shorter than ``K - 1``, from the old history it already
holds. A ``tl.debug_barrier`` puts every thread's reads of the old history before any
write. No other program touches the slot, so no ordering between programs is needed.

The taps are summed in order without fused multiply-adds, as the reference's float32
``sum`` does, so the pre-activation sums agree bit for bit; ``silu``'s ``exp`` may still
differ from torch's in the last bit. Decode rows and prefill chunks share the kernel:
``BLOCK_T`` shrinks to the longest chunk's length (rounded up to a power of two), so a
decode-only batch gets one program per row and channel block, as before.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.causal_conv import check_split

#: tokens x channels per prefill program, from scripts/gpu_prefill_kernels_check.py on an
#: H200: 32 x 128 with 4 warps was the fastest tried at 2k and 8k tokens (27B shape, 8k:
#: 0.24 ms, against 0.30 for 64 x 128 and 6.3 for the token-by-token kernel before)
BLOCK_T = 32
BLOCK_C = 128


# the batch's counts vary step to step: specialised, a count of 1 (search_steps of a two-sequence
# batch) or a row total divisible by 16 would each compile another variant while serving
# (session 32 caught one beside decodes at 1.05 s)
@triton.jit(do_not_specialize=["num_seqs", "search_steps", "total_rows"])
def _causal_conv_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, starts_ptr, seq_lens_ptr, slots_ptr,
    num_seqs, search_steps, channels, stride_x, stride_w, stride_slot, stride_hist, total_rows, split1, split2,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    # the last sequence whose first block is at or before this one (both bounds are
    # tensors from the start: an argument equal to 1 is a constant to Triton's compiler)
    lo = b * 0
    hi = b * 0 + num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        first = (tl.load(starts_ptr + mid) + mid * (BLOCK_T - 1)) // BLOCK_T
        lo = tl.where(first <= b, mid, lo)
        hi = tl.where(first <= b, hi, mid - 1)
    seq = lo
    block = b - (tl.load(starts_ptr + seq) + seq * (BLOCK_T - 1)) // BLOCK_T
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    t0 = start + block * BLOCK_T
    if t0 >= end:
        return

    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    rows = t0 + tl.arange(0, BLOCK_T)
    row_ok = rows < end
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cached = tl.load(seq_lens_ptr + seq) - (end - start)  # tokens before this chunk: 0 starts fresh
    state = state_ptr + slot * stride_slot
    # (flags are broadcast through a vector: Triton's interpreter rejects scalar-and-block masks)
    has_history = ((rows * 0 + cached) > 0) & ((rows * 0 + slot) >= 0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + cols * stride_w + j, mask=col_ok, other=0.0).to(tl.float32)
        pos = rows - (K - 1) + j  # input row of the tap; rows before `start` live in the state
        in_x = pos >= start
        xv = tl.load(x_ptr + pos[:, None] * stride_x + cols[None, :],
                     mask=(row_ok & in_x)[:, None] & col_ok[None, :], other=0.0)
        hist = K - 1 + pos - start
        sv = tl.load(state + hist[:, None] * stride_hist + cols[None, :],
                     mask=(row_ok & ~in_x & has_history)[:, None] & col_ok[None, :], other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]  # one of the two is zero
    out = acc / (1.0 + tl.exp(-acc))
    # the output is up to three contiguous [T, width] parts, one after the other in one
    # buffer (channels [0, split1), [split1, split2), [split2, channels)); unsplit, it is
    # one contiguous [T, channels] tensor (split1 == split2 == channels)
    in_2 = cols >= split1
    in_3 = cols >= split2
    width = tl.where(in_3, channels - split2, tl.where(in_2, split2 - split1, split1)).to(tl.int64)
    first = tl.where(in_3, split2, tl.where(in_2, split1, 0)).to(tl.int64)
    dest = out_ptr + first[None, :] * total_rows + rows[:, None] * width[None, :] + (cols - first)[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    if block == 0:
        # new history: the last K - 1 inputs, some still from the old history for short chunks
        # (fresh names: Triton rejects a branch that redefines a variable with another shape)
        r = tl.arange(0, KP)
        src = end - (K - 1) + r
        from_x = src >= start
        live = (r < K - 1) & ((r * 0 + slot) >= 0)
        has_old = ((r * 0 + cached) > 0) & live & ~from_x
        hx = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :],
                     mask=(live & from_x)[:, None] & col_ok[None, :], other=0.0)
        hs = tl.load(state + (K - 1 + src - start)[:, None] * stride_hist + cols[None, :],
                     mask=has_old[:, None] & col_ok[None, :], other=0.0)
        tl.debug_barrier()  # every read of the old history happens before it is overwritten
        new = hx.to(state_ptr.dtype.element_ty) + hs
        tl.store(state + r[:, None] * stride_hist + cols[None, :], new, mask=live[:, None] & col_ok[None, :])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, batch: ForwardBatch,
    split: Sequence[int] | None = None, *, block_t: int = BLOCK_T, block_c: int = BLOCK_C, num_warps: int = 4,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Same contract as :func:`ninfer_kernels.causal_conv.causal_conv1d`, plus negative
    ``state_slots`` (zero history, nothing written). With ``split`` the parts are written
    straight into their own contiguous tensors (no copies after). ``block_t``/``block_c``/
    ``num_warps`` are tuning knobs for benchmarks."""
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.reshape(weight.shape[0], -1)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    channels, k = weight.shape
    assert 2 <= k <= block_t + 1, "the first token block must hold every tap that reads the history"
    widths = check_split(split, channels)
    rows_total = x.shape[0]
    flat = torch.empty(rows_total * channels, dtype=x.dtype, device=x.device)
    parts = [p.view(rows_total, w) for p, w in zip(flat.split([rows_total * w for w in widths]), widths)]
    result = tuple(parts) if split is not None else parts[0]
    num_seqs = batch.num_seqs
    valid = sum(batch.query_lens_host) if num_seqs else 0
    if valid < rows_total:
        for part in parts:
            part[valid:].zero_()  # rows past the last sequence
    if num_seqs == 0:
        return result
    # a decode-only batch gets one row per program; otherwise every chunk fits in blocks of
    # block_t (and a chunk shorter than K - 1 still in one block: block_t >= K - 1)
    bt = min(block_t, triton.next_power_of_2(max(1, batch.max_query_len)))
    grid = ((x.shape[0] + num_seqs * (bt - 1)) // bt, triton.cdiv(channels, block_c))
    _causal_conv_kernel[grid](
        x, weight, states, flat, batch.query_start, batch.seq_lens, batch.state_slots,
        num_seqs, (num_seqs - 1).bit_length(), channels,
        x.stride(0), weight.stride(0), states.stride(0), states.stride(1), rows_total,
        widths[0], widths[0] + (widths[1] if len(widths) > 1 else 0),
        K=k, KP=triton.next_power_of_2(k - 1), BLOCK_T=bt, BLOCK_C=block_c,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return result
