"""Gated DeltaNet's token mixer after the input projection in one Triton launch.

See :mod:`ninfer_kernels.gated_delta_decode` for the contract. Op by op, a decode step is
a conv launch, several elementwise gate ops, the delta-rule launch and the norm's ops,
each a round trip through memory for a few kilobytes; here one program per (sequence,
value head) does all of it for its sequence's tokens (or ``NV`` programs per value
head, each owning ``Dv / NV`` columns of its state, see the end), in order:

1. the conv (+ silu) of its key head's query and key channels and its own value
   channels: taps inside the chunk come from the projection rows, earlier ones from the
   slot's history (the tap logic of :mod:`.causal_conv`); rounded to the model dtype;
2. L2-normalised query and key, ``sigmoid(b)``, the decay, and the delta rule on the
   head's whole [Dk, Dv] float32 state held in registers (all of Dv, so the norm below
   sees the whole head without a second pass);
3. the gated RMSNorm of the head's output row, stored.

Rounding follows the chain where it rounds (see the reference). Unlike :mod:`.causal_conv`
the launch keeps fused multiply-adds (the delta rule is most of the arithmetic), so a
float32 sum may differ from the reference's in its last bit, and a bf16 result then by
an ulp now and then.

After the token loop the program writes the history of its value channels (none of it
for a padding sequence, whose slot is negative). The query and key channels of key head
``kh`` are read by all ``Hv / Hk`` programs of that key head, so only the last of them to
finish may overwrite their history: each program bumps a per-(sequence, key head) counter
once it has read the old history, and the one that sees the count reach the group size
writes it and zeroes the counter for the next call (the counter trick of
:mod:`.decode_attention`, with its never-freed buffer). The state is stored last, after
the counter (see :func:`_decode_tail`).

Small batches leave most of the GPU idle with one program per head (the 35B-A3B shape
at batch 1 launches 32), so :func:`launch_shape` splits each head's value columns over
``NV`` programs. Every column of the delta rule is independent, but the gated norm needs
the whole row: split programs store their rounded ``o`` and their share of its sum of
squares, and the last of the key head's ``GROUP * NV`` programs (the same counter) sums
each row's shares in order and normalises the group's rows in place.

With PDL (:mod:`.pdl`) the state, the conv taps and the per-head constants are read
before the kernel waits for the projection before it.

Speculative verify rows (:func:`gated_delta_verify`) run the same program with
``PER_POSITION``: a sequence's slot is only read, and after each of its tokens the
program stores its part of the state and the conv history to that token's own row (so
rejecting drafts costs a copy of one row, see :mod:`ninfer.engine.spec.scratch`). The
rows differ from the slot it reads, so nothing waits on a counter before writing the
history: the first program of each key head writes its q/k part, and split heads are
normalised by the last of each value head's ``NV`` programs (a second counter). Their
token loop is :mod:`.gated_delta_verify`'s, which reads every token's inputs before the
first update.

Nothing here reads a device value on the host, so the launch can be captured in a CUDA
graph once the counter buffer exists (the warm-up passes allocate it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.gated_delta import L2_EPS
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.gated_delta_parts import (
    _conv_row, _delta_step, _gated_norm, _new_history, _round, _store_history, _store_output,
)
from ninfer_kernels.triton.gated_delta_verify import _verify_tokens
from ninfer_kernels.triton.tuned_tables import forced

#: warps per program, from scripts/gpu_gdn_decode_check.py on an H200 (Dk = Dv = 128, the
#: state tile 16K floats): 4 warps beat 8 and 16 everywhere, e.g. at the 27B shape 18.2 /
#: 22.0 / 31.4 us at batch 1 and 43.7 / 62.6 / 111.9 us at batch 8
NUM_WARPS = 4
#: a launch of fewer programs than this splits each value head's columns over 2, 4, ...
#: programs (never under MIN_SPLIT_COLUMNS columns each), so small batches still keep
#: enough state reads in flight; split launches of MANY_PROGRAMS or more use 2 warps
#: each, smaller ones 4. Measured (scripts/gpu_gdn_decode_check.py, H200, Dv = 128):
#: 4 splits were fastest at batch 1 and 8 on both hybrid shapes; 27B batch 1 15.0 us
#: (18.2 whole heads), batch 8 40.5 us at 2 warps (43.4 whole heads, 48.3 at 4 warps),
#: 35B-A3B batch 1 14.1 us (18.1).
TARGET_PROGRAMS = 2048
MIN_SPLIT_COLUMNS = 32
MANY_PROGRAMS = 1024


def launch_shape(num_seqs: int, num_v_heads: int, head_v_dim: int, device: torch.device) -> tuple[int, int]:
    """(warps, value splits) for a launch; CPU (the interpreter) runs whole heads.
    ``NINFER_GDN_WARPS`` fixes the warps, ``NINFER_GDN_VALUE_SPLITS`` the splits (both read
    per launch, for benchmarks): inside whole steps PDL hides the state's read behind the
    projection before, which timings of the launch alone cannot show."""
    if device.type != "cuda":
        return NUM_WARPS, 1
    if pinned := forced("NINFER_GDN_VALUE_SPLITS"):
        splits = min(pinned, triton.next_power_of_2(head_v_dim))
    else:
        splits = 1
        while num_seqs * num_v_heads * splits < TARGET_PROGRAMS and head_v_dim // (2 * splits) >= MIN_SPLIT_COLUMNS:
            splits *= 2
    warps = NUM_WARPS if splits == 1 else 2 if num_seqs * num_v_heads * splits >= MANY_PROGRAMS else 4
    return forced("NINFER_GDN_WARPS") or warps, splits


# one variant for every batch: the counts only bound loops and masks, and each value Triton
# specialises (1, multiples of 16) compiled a variant of its own while serving (session 36:
# 2-3 s each, the warm-up's batches and verify widths did not cover them all)
@triton.jit(do_not_specialize=["num_seqs", "num_rows"])
def _gdn_decode_kernel(
    proj_ptr, cw_ptr, conv_ptr, ssm_ptr, a_log_ptr, dt_bias_ptr, nw_ptr, out_ptr,
    starts_ptr, seq_lens_ptr, slots_ptr, count_ptr, sumsq_ptr, rows_ptr,
    num_seqs, num_rows, eps, l2_eps, scale,
    stride_p, stride_cw, stride_cs, stride_ch, stride_ss, stride_sh, stride_sk, stride_o, stride_rows,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    BH: tl.constexpr, ROUND_SCALE: tl.constexpr, BF16: tl.constexpr, USE_PDL: tl.constexpr,
    PER_POSITION: tl.constexpr, W: tl.constexpr = 1, WP: tl.constexpr = 2, GP: tl.constexpr = 1,
):
    seq = tl.program_id(0)
    head = tl.program_id(1) // NV
    part = tl.program_id(1) % NV  # which BV columns of the head's value dim this program owns
    k_head = head // GROUP
    HV: tl.constexpr = HK * GROUP
    KEY: tl.constexpr = HK * DK
    CONV: tl.constexpr = 2 * KEY + HV * DV
    dtype = out_ptr.dtype.element_ty
    dk = tl.arange(0, BK)
    dv = part * BV + tl.arange(0, BV)
    taps = tl.arange(0, KP)
    dk_ok = dk < DK
    dv_ok = dv < DV
    # int64 row indices: the loop variable then indexes large tensors without overflow
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    cached = tl.load(seq_lens_ptr + seq) - (end - start)  # tokens before this chunk: 0 starts fresh
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # padding sequences (negative slot) start from zeros and write nothing
    slot_row = tl.maximum(slot, 0)
    hist_ptr = conv_ptr + slot_row * stride_cs
    # (flags are broadcast through vectors: Triton's interpreter rejects scalar-and-block masks)
    has_history = ((taps * 0 + cached) > 0) & ((taps * 0 + slot) >= 0)
    has_state = ((dk * 0 + cached) > 0) & ((dk * 0 + slot) >= 0)

    # The state first: it is most of what the program reads, and nothing else waits on it.
    s_ptrs = ssm_ptr + slot_row * stride_ss + head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask & has_state[:, None], other=0.0).to(tl.float32)

    q_cols = k_head * DK + dk
    k_cols = KEY + k_head * DK + dk
    v_cols = 2 * KEY + head * DV + dv
    tap_ok = taps < K
    w_q = tl.load(cw_ptr + q_cols[:, None] * stride_cw + taps[None, :], mask=dk_ok[:, None] & tap_ok[None, :],
                  other=0.0).to(tl.float32)
    w_k = tl.load(cw_ptr + k_cols[:, None] * stride_cw + taps[None, :], mask=dk_ok[:, None] & tap_ok[None, :],
                  other=0.0).to(tl.float32)
    w_v = tl.load(cw_ptr + v_cols[:, None] * stride_cw + taps[None, :], mask=dv_ok[:, None] & tap_ok[None, :],
                  other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    nw = tl.load(nw_ptr + dv, mask=dv_ok, other=0.0).to(tl.float32)
    if USE_PDL:  # all of the above was written before the projection; its rows come next
        pdl.wait()

    if PER_POSITION:  # verify rows: W tokens a sequence, each state to its own row
        _verify_tokens(
            proj_ptr, hist_ptr, conv_ptr, ssm_ptr, out_ptr, sumsq_ptr, rows_ptr, s, w_q, w_k, w_v, neg_a, dt_bias,
            seq, head, part, start, has_history, q_cols, k_cols, v_cols, dk, dv, dk_ok, dv_ok, s_mask, nw, eps,
            l2_eps, scale, stride_p, stride_cs, stride_ch, stride_ss, stride_sh, stride_sk, stride_o, stride_rows,
            HV, GROUP, DV, CONV, K, KP, W, WP, NV, ROUND_SCALE, BF16,
        )
    else:
        for t in range(start, end):
            q = _conv_row(proj_ptr, hist_ptr, w_q, t, start, stride_p, stride_ch, q_cols, dk_ok, has_history, K, KP)
            k = _conv_row(proj_ptr, hist_ptr, w_k, t, start, stride_p, stride_ch, k_cols, dk_ok, has_history, K, KP)
            v = _conv_row(proj_ptr, hist_ptr, w_v, t, start, stride_p, stride_ch, v_cols, dv_ok, has_history, K, KP)
            q = _round(q, dtype, BF16)
            k = _round(k, dtype, BF16)
            v = _round(v, dtype, BF16)
            row = proj_ptr + t * stride_p
            z = tl.load(row + CONV + head * DV + dv, mask=dv_ok, other=0.0).to(tl.float32)
            b = tl.load(row + CONV + HV * DV + head).to(tl.float32)
            a = tl.load(row + CONV + HV * DV + HV + head).to(tl.float32) + dt_bias
            s, o = _delta_step(s, q, k, v, b, a, neg_a, l2_eps, scale, dtype, BF16)
            _store_output(o, z, nw, eps, out_ptr, sumsq_ptr, t, head, part, dv, dv_ok, stride_o, HV, DV, NV,
                          ROUND_SCALE, BF16)

    if seq == num_seqs - 1:  # rows past the last sequence are zeros, as the chained ops give
        for t in range(end, num_rows):
            tl.store(out_ptr + t * stride_o + head * DV + dv, tl.zeros([BV], dtype), mask=dv_ok)

    if PER_POSITION:  # (verify rows wrote their states above; the working slot is only read)
        if NV > 1:
            tl.debug_barrier()  # every thread's o and share of the sum are stored before the counter moves
            counter = count_ptr + num_seqs * HK + seq * HV + head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NV - 1:
                _norm_rows(proj_ptr, out_ptr, nw_ptr, sumsq_ptr, start, end, head, 1, eps, stride_p, stride_o,
                           HV, DV, CONV, NV, BH, 1, ROUND_SCALE, BF16)
                tl.store(counter, 0)
    else:
        _decode_tail(proj_ptr, hist_ptr, ssm_ptr, s_ptrs, s, s_mask, out_ptr, nw_ptr, count_ptr, sumsq_ptr, live, seq,
                     k_head, start, end, has_history, q_cols, k_cols, v_cols, dk_ok, dv_ok, eps, stride_p, stride_ch,
                     stride_o, HK, GROUP, DV, CONV, K, KP, NV, BH, GP, ROUND_SCALE, BF16)


@triton.jit
def _norm_rows(proj_ptr, out_ptr, nw_ptr, sumsq_ptr, start, end, first_head, num_heads, eps, stride_p, stride_o,
               HV: tl.constexpr, DV: tl.constexpr, CONV: tl.constexpr, NV: tl.constexpr, BH: tl.constexpr,
               GP: tl.constexpr, ROUND_SCALE: tl.constexpr, BF16: tl.constexpr):
    """The gated norm of ``num_heads`` (at most GP) value heads' output rows, in place, once
    all their ``NV`` programs stored ``o`` and their shares of its sum of squares."""
    dtype = out_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, GP)
    heads_ok = tl.arange(0, GP) < num_heads
    cols = tl.arange(0, BH)
    ok = heads_ok[:, None] & (cols < DV)[None, :]
    parts = tl.arange(0, NV)
    nw_all = tl.load(nw_ptr + cols, mask=cols < DV, other=0.0).to(tl.float32)
    for t in range(start, end):
        rows = out_ptr + t * stride_o + heads[:, None] * DV + cols[None, :]
        o_all = tl.load(rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        sq = tl.sum(tl.load(sumsq_ptr + (t * HV + heads[:, None]) * NV + parts[None, :], mask=heads_ok[:, None],
                            other=0.0, cache_modifier=".cg"), axis=1)
        z = tl.load(proj_ptr + t * stride_p + CONV + heads[:, None] * DV + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        y = _gated_norm(o_all, sq[:, None], z, nw_all[None, :], eps, DV, dtype, ROUND_SCALE, BF16)
        tl.store(rows, y.to(dtype), mask=ok)


@triton.jit
def _decode_tail(proj_ptr, hist_ptr, ssm_ptr, s_ptrs, s, s_mask, out_ptr, nw_ptr, count_ptr, sumsq_ptr, live, seq,
                 k_head, start, end, has_history, q_cols, k_cols, v_cols, dk_ok, dv_ok, eps, stride_p, stride_ch,
                 stride_o, HK: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr, CONV: tl.constexpr,
                 K: tl.constexpr, KP: tl.constexpr, NV: tl.constexpr, BH: tl.constexpr, GP: tl.constexpr,
                 ROUND_SCALE: tl.constexpr, BF16: tl.constexpr):
    """A decode program's end: the histories, the split heads' norm, and the state last.

    One counter per (sequence, key head) serves both things that wait for the key head's
    ``GROUP * NV`` programs: the last to arrive writes the q/k history and (split heads)
    normalises the group's rows, one atomic round trip a program where a counter for each
    took two. The state is stored after the counter, since an atomic with release
    semantics first waits for every store before it. Inside whole 35B-A3B steps at batch 1
    (H100, session 44) this end saved 22 us a step against the state first and two
    counters; the state last with two counters saved nothing measurable."""
    HV: tl.constexpr = HK * GROUP
    # the old history is read (into registers) before this program's counter moves
    new_v = _new_history(proj_ptr, hist_ptr, start, end, stride_p, stride_ch, v_cols, dv_ok, has_history, K, KP)
    new_q = _new_history(proj_ptr, hist_ptr, start, end, stride_p, stride_ch, q_cols, dk_ok, has_history, K, KP)
    new_k = _new_history(proj_ptr, hist_ptr, start, end, stride_p, stride_ch, k_cols, dk_ok, has_history, K, KP)
    tl.debug_barrier()  # every thread's history reads, o and sums are done before any write or count
    if live:
        _store_history(hist_ptr, new_v, stride_ch, v_cols, dv_ok, K, KP)
    if GROUP * NV == 1:
        if live:
            _store_history(hist_ptr, new_q, stride_ch, q_cols, dk_ok, K, KP)
            _store_history(hist_ptr, new_k, stride_ch, k_cols, dk_ok, K, KP)
    else:
        counter = count_ptr + seq * HK + k_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == GROUP * NV - 1:
            if live:
                _store_history(hist_ptr, new_q, stride_ch, q_cols, dk_ok, K, KP)
                _store_history(hist_ptr, new_k, stride_ch, k_cols, dk_ok, K, KP)
            if NV > 1:
                _norm_rows(proj_ptr, out_ptr, nw_ptr, sumsq_ptr, start, end, k_head * GROUP, GROUP, eps, stride_p,
                           stride_o, HV, DV, CONV, NV, BH, GP, ROUND_SCALE, BF16)
            tl.store(counter, 0)
    if live:
        tl.store(s_ptrs, s.to(ssm_ptr.dtype.element_ty), mask=s_mask)


def gated_delta_decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
    num_warps: int | None = None,
    value_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as the reference. ``num_warps`` and ``value_splits`` (programs per
    value head, each owning ``Dv / value_splits`` columns of its state) override
    :func:`launch_shape`."""
    return _launch(proj, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, eps, num_k_heads,
                   head_k_dim, batch, None, num_warps, value_splits)


def gated_delta_verify(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
    position_rows: torch.Tensor,
    num_warps: int | None = None,
    value_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as the reference: one launch reads each sequence's slot once and
    writes the state after every one of its tokens to that token's row."""
    return _launch(proj, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, eps, num_k_heads,
                   head_k_dim, batch, position_rows, num_warps, value_splits)


def _launch(proj, conv_weight, conv_states, ssm_states, a_log, dt_bias, norm_weight, eps, num_k_heads, head_k_dim,
            batch: ForwardBatch, position_rows, num_warps, value_splits) -> torch.Tensor:
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    num_v_heads, head_v_dim = a_log.shape[0], norm_weight.shape[0]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads do not group onto {num_k_heads} key heads")
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    if proj.shape[-1] != conv_dim + num_v_heads * head_v_dim + 2 * num_v_heads:
        raise ValueError(f"projection rows of width {proj.shape[-1]} do not match the head layout")
    weight = conv_weight.reshape(conv_weight.shape[0], -1)
    if weight.shape[0] != conv_dim or conv_states.shape[-1] != conv_dim:
        raise ValueError(f"conv weight and history must have {conv_dim} channels")
    if conv_states.stride(-1) != 1 or ssm_states.stride(-1) != 1:
        raise ValueError("the state pools are updated in place: they must be contiguous in their last dimension")
    if proj.stride(-1) != 1:
        proj = proj.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    tokens = proj.shape[0]
    out = torch.empty(tokens, num_v_heads * head_v_dim, dtype=proj.dtype, device=proj.device)
    num_seqs = batch.num_seqs
    if num_seqs == 0:
        return out.zero_()
    warps, splits = launch_shape(num_seqs, num_v_heads, head_v_dim, proj.device)
    if position_rows is not None and proj.device.type == "cuda":
        # verify rows hold every token's inputs and histories at once: with fewer warps the
        # registers spilled (ptxas, triton 3.6, sm_90: at the 27B's heads 28 bytes on 4 warps,
        # 820 on batch 8's 2; 4 bytes at gpu-deep's on 4), with 8 none (128 and 94 registers)
        warps = max(warps, 8)
    warps, splits = num_warps or warps, value_splits or splits
    if splits & (splits - 1) or splits > triton.next_power_of_2(head_v_dim):
        raise ValueError(f"value_splits must be a power of two no larger than the value head dim {head_v_dim}")
    # the q/k history counters (one per sequence and key head), then the norm's (per value head)
    counters = counter_buffer("gated_delta_decode", proj.device, num_seqs * (num_k_heads + num_v_heads),
                              minimum=1 << 13)
    sumsq = torch.empty(tokens, num_v_heads, splits, dtype=torch.float32, device=proj.device) if splits > 1 else out
    use_pdl = pdl.enabled(proj.device)
    if position_rows is None:
        rows = batch.state_slots.view(-1, 1)  # (not read without PER_POSITION)
    elif position_rows.shape[0] != num_seqs or position_rows.stride(-1) != 1:
        raise ValueError("position_rows must be [num_seqs, width], contiguous in its last dimension")
    else:
        rows = position_rows
    # torch's type promotion of ``weight * normed``: rounded unless one side is float32
    round_scale = torch.promote_types(norm_weight.dtype, proj.dtype) != torch.float32
    _gdn_decode_kernel[(num_seqs, num_v_heads * splits)](
        proj, weight, conv_states, ssm_states, a_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(),
        out, batch.query_start, batch.seq_lens, batch.state_slots, counters, sumsq, rows,
        num_seqs, tokens, eps, L2_EPS, head_k_dim**-0.5,
        proj.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), out.stride(0), rows.stride(0),
        HK=num_k_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        K=weight.shape[1], KP=triton.next_power_of_2(weight.shape[1]),
        BK=triton.next_power_of_2(head_k_dim), BV=triton.next_power_of_2(head_v_dim) // splits, NV=splits,
        BH=triton.next_power_of_2(head_v_dim), ROUND_SCALE=round_scale, BF16=proj.dtype == torch.bfloat16,
        USE_PDL=use_pdl, PER_POSITION=position_rows is not None, W=rows.shape[1],
        WP=max(2, triton.next_power_of_2(rows.shape[1])), GP=triton.next_power_of_2(num_v_heads // num_k_heads),
        num_warps=warps, **pdl.launch_options(use_pdl),
    )
    return out
