"""MoE routing and the expert-sorted layout on CUDA, free of host syncs.

Decode steps are replayed from CUDA graphs, so nothing here reads a device value on the
host: every buffer is sized from the pair count alone (see :mod:`ninfer_kernels.moe`).

* :func:`moe_route`: one program per token loads its logits row, picks ``top_k`` experts
  by rounds of "largest, lowest index holding it, mask it out" (ties to the lower id, as
  the reference's stable sort gives; one 64-bit reduction a round) and takes their softmax
  probabilities in float32; with a shared expert it also takes the token's gate dot
  product.
* :func:`moe_align`: up to ``SMALL_PAIRS`` pairs (decode), one program works everything
  out from comparisons of all pairs with each other, in registers. Beyond that, one
  program counts the pairs per expert, lays out the padded runs, then scatters the pairs
  a chunk at a time. Inside a chunk a pair's rank among the
  earlier pairs of its expert comes from a [CHUNK, CHUNK] comparison; across chunks the
  next free row of each expert lives in a small global scratch buffer, read by pointer
  gathers. Being a single CTA, ``tl.debug_barrier`` orders those reads and writes.
  Past ``KERNEL_MAX_PAIRS`` pairs (large batches, prefill) the chunk loop of one CTA
  grows long, and four launches spread over the GPU serve instead
  (:mod:`.moe_align_grid`, whose runs step this kernel shares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.moe import max_padded_rows
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.moe_align_grid import align_grid, store_runs
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: pairs per chunk of the align kernel (the rank comparison holds CHUNK x CHUNK flags)
CHUNK = 128
#: up to this many pairs (decode batches) one chunk holds them all: a kernel without the
#: per-expert histogram and scratch buffer does it (the general one took 15-20 us at T=1..8)
SMALL_PAIRS = 128
#: block_experts entries one comparison pass of the align kernel fills
BLOCK_CHUNK = 64
#: above this many pairs the four-launch grid path serves (8192-token prefill has 73,728).
#: A guess until scripts/gpu_moe_check.py's align timings place it: the one-program kernel
#: costs a chunk's comparisons per 128 pairs, the grid path four launches whatever the count.
KERNEL_MAX_PAIRS = 1024


@triton.jit
def pick_experts(logits, e_ok, g, w_out, ids_out, num_experts, TOP_K: tl.constexpr, K_OUT: tl.constexpr,
                 RENORM: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KO: tl.constexpr,
                 KEY32: tl.constexpr = False):
    """Store one token's ``K_OUT`` weights and expert ids at ``w_out`` / ``ids_out`` from its
    float32 router ``logits`` [BLOCK_E] (lanes past ``e_ok`` -inf) and, with a shared
    expert, its rounded gate logit ``g``."""
    weights, ids = top_experts(logits, e_ok, g, num_experts, TOP_K, RENORM, HAS_SHARED, BLOCK_E, BLOCK_KO, KEY32)
    cols = tl.arange(0, BLOCK_KO)
    tl.store(w_out + cols, weights, mask=cols < K_OUT)
    tl.store(ids_out + cols, ids, mask=cols < K_OUT)


@triton.jit
def top_experts(logits, e_ok, g, num_experts, TOP_K: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_KO: tl.constexpr, KEY32: tl.constexpr = False):
    """:func:`pick_experts`' weights and ids [BLOCK_KO] (float32, int32), kept in registers:
    the top ``TOP_K`` picks, then the shared expert (id ``num_experts``) when there is one.
    ``KEY32``: the logits are bf16 values (their float32 bits' low half is zero)."""
    offs_e = tl.arange(0, BLOCK_E)
    # The softmax keeps the logits' order, so the top-k is taken on the logits, each round
    # one reduction of a key: the logit's bits made to order as signed integers (negative
    # floats' magnitude bits flipped) above the lane's reversed index, so the largest key
    # is the largest logit at its lowest expert id (the reference's tie-break). Two
    # reductions a round (the value, then its lowest index) made this kernel most of the
    # routing's 4.6 us a layer at batch 1 (docs/performance.md, session 7).
    bits = (logits + 0.0).to(tl.int32, bitcast=True)  # -0.0 becomes +0.0: equal logits tie
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    cols = tl.arange(0, BLOCK_KO)
    weights = tl.zeros([BLOCK_KO], dtype=tl.float32)
    ids = tl.zeros([BLOCK_KO], dtype=tl.int32)
    if KEY32:
        # A bf16 logit's order fits the high 16 bits exactly (its float32 bits' low half
        # is zero, all ones once flipped), the index the low 16: a 32-bit key, whose
        # reduction takes half the shuffles of the 64-bit one, with the same picks.
        key32 = ((order >> 16) << 16) | (BLOCK_E - 1 - offs_e)
        key32 = tl.where(e_ok, key32, -2147483647 - 1)  # padding lanes below every expert
        for j in tl.static_range(TOP_K):
            best = tl.max(key32, 0)
            idx = BLOCK_E - 1 - (best & 0xFFFF)
            picked = best >> 16  # the bf16 order, sign-extended
            value = (tl.where(picked < 0, picked ^ 0x7FFF, picked) << 16).to(tl.float32, bitcast=True)
            weights = tl.where(cols == j, value, weights)  # the logit for now
            ids = tl.where(cols == j, idx, ids)
            key32 = tl.where(offs_e == idx, -2147483647 - 1, key32)
    else:
        key = (order.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)
        key = tl.where(e_ok, key, -9223372036854775807 - 1)  # padding lanes below every expert
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 0)
            idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            picked = (best >> 32).to(tl.int32)
            value = tl.where(picked < 0, picked ^ 0x7FFFFFFF, picked).to(tl.float32, bitcast=True)
            weights = tl.where(cols == j, value, weights)  # the logit for now
            ids = tl.where(cols == j, idx, ids)
            key = tl.where(offs_e == idx, -9223372036854775807 - 1, key)
    top = tl.max(tl.where(cols == 0, weights, float("-inf")), 0)  # the first pick: the largest logit
    total = tl.sum(tl.exp(logits - top), 0)
    weights = tl.where(cols < TOP_K, tl.exp(weights - top) / total, 0.0)
    if RENORM:
        weights = weights / tl.sum(weights, 0)  # unpicked columns hold 0
    if HAS_SHARED:
        weights = tl.where(cols == TOP_K, 1.0 / (1.0 + tl.exp(-g)), weights)
        ids = tl.where(cols == TOP_K, num_experts, ids)
    return weights, ids


@triton.jit
def _route_kernel(
    logits_ptr, x_ptr, gate_ptr, w_ptr, ids_ptr,
    num_experts, hidden, stride_lt, stride_xt,
    TOP_K: tl.constexpr, K_OUT: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_KO: tl.constexpr, BLOCK_H: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr, GATE_IN_LOGITS: tl.constexpr = False, KEY32: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    g = 0.0
    # x was written before the router's matmul (the launch before this one): so under PDL
    # this part may run before the wait, overlapping that matmul's end. With the gate's
    # logit in the logits (GATE_IN_LOGITS) x may come from the launch just before: not read
    if HAS_SHARED and not GATE_IN_LOGITS:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < hidden
            xv = tl.load(x_ptr + t * stride_xt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            gv = tl.load(gate_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            acc += xv * gv
        # rounded to x's dtype as the gate Linear's output would be, then the sigmoid
        g = round_to(tl.sum(acc, 0), x_ptr.dtype.element_ty, ROUND).to(tl.float32)
    if USE_PDL:
        pdl.wait()  # the logits come from the matmul just before
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < num_experts
    logits = tl.load(logits_ptr + t * stride_lt + offs_e, mask=e_ok, other=float("-inf")).to(tl.float32)
    if GATE_IN_LOGITS:  # already rounded to the model dtype
        g = tl.load(logits_ptr + t * stride_lt + num_experts).to(tl.float32)
    pick_experts(logits, e_ok, g, w_ptr + t * K_OUT, ids_ptr + t * K_OUT, num_experts,
                 TOP_K, K_OUT, RENORM, HAS_SHARED, BLOCK_E, BLOCK_KO, KEY32)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    x: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    gate_in_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.moe.moe_route`."""
    num_tokens, num_experts = logits.shape
    num_experts -= gate_in_logits
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    has_shared = shared_gate is not None or gate_in_logits
    if shared_gate is not None and x is None and not gate_in_logits:
        raise ValueError("the shared expert's gate needs x")
    k_out = top_k + has_shared
    weights = torch.empty(num_tokens, k_out, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k_out, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if has_shared and not gate_in_logits:
        gate = shared_gate.reshape(-1)
        x = x if x.stride(-1) == 1 else x.contiguous()
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        hidden, stride_xt = x.shape[1], x.stride(0)
    else:
        x = gate = logits  # unused
        hidden, stride_xt = 0, 0
    use_pdl = pdl.enabled(logits.device)
    _route_kernel[(num_tokens,)](
        logits, x, gate, weights, ids, num_experts, hidden, logits.stride(0), stride_xt,
        TOP_K=top_k, K_OUT=k_out, RENORM=renormalize, HAS_SHARED=has_shared,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_KO=triton.next_power_of_2(k_out),
        BLOCK_H=min(1024, triton.next_power_of_2(max(hidden, 16))), ROUND=interpreted_bf16(x),
        USE_PDL=use_pdl, GATE_IN_LOGITS=gate_in_logits, KEY32=logits.dtype == torch.bfloat16,
        num_warps=4 if num_experts > 128 else 2,
        **pdl.launch_options(use_pdl),
    )
    return weights, ids


@triton.jit(do_not_specialize=["pairs", "rows"])
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, next_row_ptr,
    pairs, rows, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl.wait()  # the ids come from the routing kernel just before
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < num_experts
    offs_c = tl.arange(0, CHUNK)
    # 1. pairs per expert, padded run lengths, run starts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, pairs, CHUNK):
        ok = c0 + offs_c < pairs
        # pairs past the end land in the last bin, never an expert's (BLOCK_E > num_experts)
        e = tl.load(ids_ptr + c0 + offs_c, mask=ok, other=BLOCK_E - 1)
        counts += tl.histogram(e, BLOCK_E)
    # 2. the runs (each block's expert, the rows covered), and the sentinel everywhere
    starts = store_runs(counts, e_ok, rows, block_experts_ptr, num_padded_ptr, BLOCK_M, BLOCK_CHUNK)
    tl.store(next_row_ptr + offs_e, starts, mask=e_ok)  # each expert's next free row
    for r0 in range(0, rows, CHUNK):
        tl.store(sorted_ptr + r0 + offs_c, pairs + offs_c * 0, mask=r0 + offs_c < rows)
    tl.debug_barrier()  # the starts and the sentinel fill land before the scatter below
    # 3. each pair to its expert's next free row, in increasing pair order
    earlier = offs_c[None, :] < offs_c[:, None]  # [i, j]: j comes before i
    later = offs_c[None, :] > offs_c[:, None]
    for c0 in range(0, pairs, CHUNK):
        ok = c0 + offs_c < pairs
        e = tl.load(ids_ptr + c0 + offs_c, mask=ok, other=-1)  # -1 matches no real pair
        same = (e[:, None] == e[None, :]) & ok[:, None]
        rank = tl.sum((same & earlier).to(tl.int32), 1)
        last = tl.sum((same & later).to(tl.int32), 1) == 0  # no later pair of this expert here
        # .cg: through L2, never an L1 line from before the last chunk's moves
        dest = tl.load(next_row_ptr + e, mask=ok, other=0, cache_modifier=".cg") + rank
        tl.store(sorted_ptr + dest, c0 + offs_c, mask=ok)
        tl.debug_barrier()  # every thread read its expert's row before any is moved on
        tl.store(next_row_ptr + e, dest + 1, mask=ok & last)
        tl.debug_barrier()  # and the moves land before the next chunk reads them


@triton.jit(do_not_specialize=["rows"])
def _align_small_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, pairs, rows,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    """All ``pairs`` (at most BLOCK_P) at once, everything from [BLOCK_P, BLOCK_P] comparisons
    in registers: no per-expert histogram, no scratch, one barrier. A pair's run starts
    after the runs of every lower expert present, each counted once through the first of
    its pairs."""
    if USE_PDL:
        pdl.wait()  # the ids come from the routing kernel just before
    i = tl.arange(0, BLOCK_P)
    ok = i < pairs
    e = tl.load(ids_ptr + i, mask=ok, other=-1)
    same = (e[:, None] == e[None, :]) & ok[:, None] & ok[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), 1)
    padded = (tl.sum(same.to(tl.int32), 1) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = ok & (rank == 0)
    lower = (e[None, :] < e[:, None]) & first[None, :]
    start = tl.sum(tl.where(lower, padded[None, :], 0), 1)
    num_padded = tl.sum(tl.where(first, padded, 0), 0)
    for r0 in range(0, rows, BLOCK_P):
        tl.store(sorted_ptr + r0 + i, pairs + i * 0, mask=r0 + i < rows)
    tl.debug_barrier()  # the sentinel fill lands before the pairs overwrite their rows
    tl.store(sorted_ptr + start + rank, i, mask=ok)
    b = tl.arange(0, BLOCK_B)
    for b0 in range(0, rows // BLOCK_M, BLOCK_B):
        row = (b0 + b) * BLOCK_M
        covers = first[None, :] & (start[None, :] <= row[:, None]) & (row[:, None] < (start + padded)[None, :])
        expert = tl.where(tl.sum(covers.to(tl.int32), 1) > 0, tl.sum(tl.where(covers, e[None, :], 0), 1), -1)
        tl.store(block_experts_ptr + b0 + b, expert, mask=b0 + b < rows // BLOCK_M)
    tl.store(num_padded_ptr, num_padded)


def _align_small_launch(ids: torch.Tensor, num_experts: int, block_m: int):
    """The one-chunk align kernel, for at most ``SMALL_PAIRS`` pairs (decode batches)."""
    flat = ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 and flat.is_contiguous() else flat.to(torch.int32).contiguous()
    pairs = flat.numel()
    rows = max_padded_rows(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    block_p = max(16, triton.next_power_of_2(pairs))
    use_pdl = pdl.enabled(ids.device)
    _align_small_kernel[(1,)](
        flat, sorted_pairs, block_experts, num_padded, pairs, rows,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_B=min(64, block_p), USE_PDL=use_pdl,
        num_warps=4 if block_p <= 64 else 8, **pdl.launch_options(use_pdl),
    )
    return sorted_pairs, block_experts, num_padded


def _align_kernel_launch(ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = CHUNK):
    """The single-program align kernel; any pair count, any ``chunk`` (a power of two)."""
    flat = ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 and flat.is_contiguous() else flat.to(torch.int32).contiguous()
    pairs = flat.numel()
    rows = max_padded_rows(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=ids.device)
    if pairs == 0:
        return sorted_pairs, block_experts, num_padded
    # a spare histogram bin for the padding lanes, and at least one bin per lane of a warp
    block_e = max(32, triton.next_power_of_2(num_experts + 1))
    next_row = torch.empty(block_e, dtype=torch.int32, device=ids.device)
    use_pdl = pdl.enabled(ids.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, block_experts, num_padded, next_row, pairs, rows, num_experts,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, BLOCK_CHUNK=min(BLOCK_CHUNK, chunk), USE_PDL=use_pdl,
        num_warps=8 if chunk >= 128 else 4, **pdl.launch_options(use_pdl),
    )
    return sorted_pairs, block_experts, num_padded


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract (and bit-identical output) as :func:`ninfer_kernels.moe.moe_align`."""
    if ids.numel() > KERNEL_MAX_PAIRS:
        return align_grid(ids, num_experts, block_m)
    if 0 < ids.numel() <= SMALL_PAIRS:
        return _align_small_launch(ids, num_experts, block_m)
    return _align_kernel_launch(ids, num_experts, block_m)
