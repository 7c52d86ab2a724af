"""The gated delta rule on CUDA: our fused recurrent Triton kernel, or fla's chunked one.

The recurrent kernel gives one program a (sequence, value head, block of value columns):
it loads that slice of the slot's state into registers, applies the delta rule token
by token, writes each output row, and stores the state back. It serves every decode
step and any batch when flash-linear-attention is not importable. Steps that carry a
prefill chunk go to fla's ``chunk_gated_delta_rule`` when it is, which turns long chunks
into matmuls; states are gathered from and scattered back to the slots around it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.gated_delta import L2_EPS
from ninfer_kernels.triton import fla_tuned

try:  # optional: fla's kernels only run on a GPU, and some Triton releases reject them
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
except Exception:  # noqa: BLE001  (an incompatible fla raises at import, not only ImportError)
    fla_chunk = None

BLOCK_V = 32
_PINNED: set = set()  # devices whose fla autotuners took the tuned table (fla_tuned)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, starts_ptr, seq_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, stride_slot, stride_sh, stride_sk,
    scale, eps,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    qk_head = head // GROUP
    dk = tl.arange(0, BK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    dv_ok = dv < DV
    # int64 row indices: the loop variable then indexes large tensors without overflow
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    cached = tl.load(seq_lens_ptr + seq) - (end - start)  # tokens before this chunk: 0 starts fresh
    s_ptrs = (
        state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_slot + head * stride_sh
        + dk[:, None] * stride_sk + dv[None, :]
    )
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    # (the flag is broadcast through a vector: Triton's interpreter rejects scalar-and-block masks)
    has_state = (dk * 0 + cached) > 0
    s = tl.load(s_ptrs, mask=s_mask & has_state[:, None], other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + qk_head * stride_qh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + qk_head * stride_kh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dv, mask=dv_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k) + eps)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dv_ok)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)


def _last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """Our Triton kernel; same contract as :func:`ninfer_kernels.gated_delta.gated_delta_rule`."""
    q, k, v, g, beta = _last_dim_contiguous(q, k, v, g, beta)
    num_v_heads, dv = v.shape[-2:]
    dk = q.shape[-1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if batch.num_seqs == 0:
        return out
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (batch.num_seqs, num_v_heads, triton.cdiv(dv, block_v))
    _recurrent_kernel[grid](
        q, k, v, g, beta, out, states, batch.query_start, batch.seq_lens, batch.state_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
        dk**-0.5, L2_EPS,
        GROUP=num_v_heads // q.shape[-2], DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        num_warps=4,
    )
    return out


@dataclass(frozen=True)
class StepLayout:
    """What every Gated DeltaNet layer of a step hands fla, made once a step from the host's
    lengths (the first layer to see the batch builds it; the rest find it by the identity of
    the batch's ``query_start``).

    * The sequence bounds, int64 on the device and on the host, the same two tensors for
      every layer: fla memoizes what it derives from them (chunk indices and offsets) by the
      tensors' identity, and derives the chunk indices on the host when it has the host
      copy. A fresh ``query_start.long()`` a layer missed that memo, and each miss read the
      device's counts back, a sync that left the GPU idle while the host queued the layer.
    * Which sequences continue from their slot's state: none (fla starts every one from
      zeros), all, or some, with the fresh ones' mask on the device."""

    query_start: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    any_continuing: bool
    fresh: torch.Tensor | None  # bool [B] on the device when only some sequences continue


_LAST_LAYOUT: list[StepLayout | None] = [None]


def step_layout(batch: ForwardBatch) -> StepLayout:
    last = _LAST_LAYOUT[0]
    if last is None or last.query_start is not batch.query_start:
        continuing = [seen > new for seen, new in zip(batch.seq_lens_host, batch.query_lens_host)]
        fresh = None
        if any(continuing) and not all(continuing):
            fresh = torch.tensor([not c for c in continuing], device=batch.query_start.device)
        bounds = torch.tensor([0, *itertools.accumulate(batch.query_lens_host)], dtype=torch.long)
        last = StepLayout(batch.query_start, batch.query_start.long(), bounds, any(continuing), fresh)
        _LAST_LAYOUT[0] = last
    return last


def _initial_states(states: torch.Tensor, batch: ForwardBatch, layout: StepLayout) -> torch.Tensor | None:
    """Each sequence's state before its chunk, float32 (zeros for one starting fresh), or
    None when every sequence starts fresh: a step of first chunks launches nothing here,
    one of later chunks the gather alone."""
    if not layout.any_continuing:
        return None
    initial = states.index_select(0, batch.state_slots).float()
    if layout.fresh is not None:
        initial.masked_fill_(layout.fresh[:, None, None, None], 0.0)
    return initial


def fla_forward(q, k, v, g, beta, initial: torch.Tensor | None, cu_seqlens: torch.Tensor,
                cu_seqlens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked rule over packed sequences ([tokens, heads, dim] each, bounds in
    ``cu_seqlens``), as the engine calls it (scripts/gpu_fla_tune.py tunes these calls):
    the output [1, tokens, heads, dv] and each sequence's final state, float32."""
    if q.device not in _PINNED:
        _PINNED.add(q.device)
        fla_tuned.pin(q.device)
    # fla takes contiguous inputs (it copies any other); the model hands them so
    return fla_chunk(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].float().contiguous(),
        beta[None].contiguous(), initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """fla's chunked kernel over the step's sequences, states gathered from their slots."""
    assert fla_chunk is not None, "flash-linear-attention is not importable"
    layout = step_layout(batch)
    initial = _initial_states(states, batch, layout)
    rows = sum(batch.query_lens_host)
    o, final = fla_forward(q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows], initial,
                           layout.cu_seqlens, layout.cu_seqlens_cpu)
    states.index_copy_(0, batch.state_slots, final.to(states.dtype))
    o = o[0].to(v.dtype)
    if rows == v.shape[0]:
        return o
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)  # rows past the last sequence
    out[:rows] = o
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """Same contract as :func:`ninfer_kernels.gated_delta.gated_delta_rule`."""
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    if fla_chunk is not None and batch.max_query_len > 1:
        return chunked_gated_delta_rule(q, k, v, g, beta, states, batch)
    return recurrent_gated_delta_rule(q, k, v, g, beta, states, batch)
