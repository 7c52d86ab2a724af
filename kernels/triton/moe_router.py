"""The MoE router's matmul and the routing in one launch, for decode batches.

At a few tokens the router is a matrix-vector product (256 experts x 2048 on the
35B-A3B shape: 1 MB of weight) followed by :mod:`.moe_route`'s small kernel: two launches
and the gap between them in every MoE layer. This kernel reads the weight as
:mod:`.skinny_linear` does, with its tuned launch shape for the router (64 programs of
32 experts by a 256-wide slice of the hidden size at that shape, all tokens in one
16-row ``tl.dot`` tile), and routes in the last program to finish, through two arrival
counters (reset after):

1. each program stores its float32 partial logits; the programs of column block 0 also
   take the shared expert's gate row, which rides along as one more logit;
2. the last split of a column block to arrive sums its partials in split order and rounds
   them to x's dtype, as the router's linear layer would, into a logits buffer;
3. the last column block to arrive picks every token's experts at once
   (:func:`.moe_route.pick_experts_rows`).

The logits are the skinny kernel's (same tiles, same order), so the experts picked are
the two launches'. Results do not depend on timing.

Opt-in (``NINFER_FUSED_ROUTER=1``), up to :data:`MAX_TOKENS` tokens. Session 20's
version, whose 16 programs a token each read a whole 128-column slice of the weight,
took 20.5 us a layer on the H200 (and cost 0.5 ms a step at batch 1 on the 35B-A3B);
this one spreads the read like the skinny kernel and waits to be timed against the two
launches (``scripts/gpu_session.sh moe35``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl, skinny_linear
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.moe_route import moe_route, pick_experts_rows
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: decode batches up to this many tokens take the one launch (one tl.dot tile of rows)
MAX_TOKENS = skinny_linear.MAX_ROWS
#: the launch shape where the skinny table has none for the router (the 35B-A3B's there)
DEFAULT_SHAPE = skinny_linear.SkinnyConfig(BLOCK_N=32, BLOCK_K=256, SPLITS=8)


def fused_router() -> bool:
    """``NINFER_FUSED_ROUTER=1`` takes the one launch (read per call); else the router's
    matmul and the routing stay apart."""
    return os.environ.get("NINFER_FUSED_ROUTER", "0") == "1"


@triton.jit(do_not_specialize=["M"])
def _router_kernel(
    x_ptr, w_ptr, gate_ptr, part_ptr, logit_ptr, count_ptr, weights_ptr, ids_ptr,
    M, num_experts, hidden, k_per_split, stride_xm, stride_we, stride_wh,
    TOP_K: tl.constexpr, K_OUT: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_KO: tl.constexpr, IEEE: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    col_blocks = tl.num_programs(0)
    row = num_experts + 1  # a token's logits, then its shared gate logit
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < num_experts
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, hidden)
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_we + (k_begin + offs_k)[:, None].to(tl.int64) * stride_wh
    # the weight is fetched before waiting for the norm that wrote x (PDL)
    b = tl.load(b_ptrs, mask=(offs_k < k_end - k_begin)[:, None] & n_ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_SHARED:
            if pid_n == 0:
                gv = tl.load(gate_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                g_acc += tl.sum(a.to(tl.float32) * gv[None, :], 1)
        if ROUND:  # the interpreter multiplies bf16 dot operands as raw bits
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wh
        b = tl.load(b_ptrs, mask=(offs_k < k_end - k0 - BLOCK_K)[:, None] & n_ok[None, :], other=0.0)
    # 1. this program's partials: [split, token, expert], the gate at expert index E
    out_mask = m_ok[:, None] & n_ok[None, :]
    parts = part_ptr + offs_m[:, None] * row + offs_n[None, :]
    tl.store(parts + split * M * row, acc, mask=out_mask)
    if HAS_SHARED:
        if pid_n == 0:
            tl.store(part_ptr + split * M * row + offs_m * row + num_experts, g_acc, mask=m_ok)
    tl.debug_barrier()  # every thread's partials are stored before the counter moves
    counter = count_ptr + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
        # 2. the column block's logits, summed in split order and rounded as the linear layer's
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(parts + s * M * row, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(logit_ptr + offs_m[:, None] * row + offs_n[None, :],
                 round_to(total, x_ptr.dtype.element_ty, ROUND).to(tl.float32), mask=out_mask)
        if HAS_SHARED:
            if pid_n == 0:
                g = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    g += tl.load(part_ptr + s * M * row + offs_m * row + num_experts, mask=m_ok, other=0.0,
                                 cache_modifier=".cg")
                tl.store(logit_ptr + offs_m * row + num_experts,
                         round_to(g, x_ptr.dtype.element_ty, ROUND).to(tl.float32), mask=m_ok)
        tl.store(counter, 0)
        tl.debug_barrier()  # the block's logits are stored before the second counter moves
        done = count_ptr + col_blocks
        if tl.atomic_add(done, 1, sem="acq_rel") == col_blocks - 1:
            # 3. every token's experts, from all the logits
            offs_e = tl.arange(0, BLOCK_E)[None, :]
            e_ok = offs_e < num_experts
            logits = tl.load(logit_ptr + offs_m[:, None] * row + offs_e, mask=m_ok[:, None] & e_ok, other=0.0,
                             cache_modifier=".cg")
            logits = tl.where(e_ok, logits, float("-inf"))
            g = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_SHARED:
                g = tl.load(logit_ptr + offs_m * row + num_experts, mask=m_ok, other=0.0, cache_modifier=".cg")
            pick_experts_rows(logits, e_ok, g, weights_ptr + offs_m[:, None] * K_OUT, ids_ptr + offs_m[:, None] * K_OUT,
                              m_ok, num_experts, TOP_K, K_OUT, RENORM, HAS_SHARED, BLOCK_E, BLOCK_KO, BLOCK_M)
            tl.store(done, 0)


def route_tokens(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.moe.route_tokens`: the router ``[E, H]`` (any
    strides) applied to ``x`` [T, H], then :func:`.moe_route.moe_route`; one launch up to
    :data:`MAX_TOKENS` tokens when switched on."""
    num_tokens, hidden = x.shape
    num_experts = router.shape[0]
    if num_tokens > MAX_TOKENS or num_tokens == 0 or not fused_router():
        from ninfer_kernels import ops  # the router's linear layer as the model would run it

        logits = ops.linear(x, router)
        return moe_route(logits, top_k, renormalize, x, shared_gate)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    has_shared = shared_gate is not None
    k_out = top_k + has_shared
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = shared_gate.reshape(-1).contiguous() if has_shared else x
    # the skinny kernel's shape for this router (so the logits are the ones it would give)
    shape = skinny_linear.choose(x, router) or DEFAULT_SHAPE
    block_n = min(shape.BLOCK_N, max(16, triton.next_power_of_2(num_experts)))
    block_k = min(shape.BLOCK_K, max(16, triton.next_power_of_2(hidden)))
    col_blocks = triton.cdiv(num_experts, block_n)
    k_per_split = triton.cdiv(triton.cdiv(hidden, shape.SPLITS), block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    row = num_experts + 1
    weights = torch.empty(num_tokens, k_out, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, k_out, dtype=torch.int32, device=x.device)
    partials = torch.empty((splits + 1) * num_tokens * row, dtype=torch.float32, device=x.device)
    logits = partials[splits * num_tokens * row:]
    counters = counter_buffer("moe_router", x.device, col_blocks + 1, 64)
    use_pdl = pdl.enabled(x.device)
    _router_kernel[(col_blocks, splits)](
        x, router, gate, partials, logits, counters, weights, ids, num_tokens, num_experts, hidden, k_per_split,
        x.stride(0), router.stride(0), router.stride(1),
        TOP_K=top_k, K_OUT=k_out, RENORM=renormalize, HAS_SHARED=has_shared, BLOCK_M=MAX_TOKENS,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_KO=triton.next_power_of_2(k_out), IEEE=x.dtype == torch.float32, ROUND=interpreted_bf16(x),
        USE_PDL=use_pdl, num_warps=shape.num_warps, num_stages=shape.num_stages, **pdl.launch_options(use_pdl),
    )
    return weights, ids
