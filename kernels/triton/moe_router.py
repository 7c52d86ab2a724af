"""The MoE router's matmul and the routing in one launch, for decode batches.

At a few tokens the router is a matrix-vector product (256 experts x 2048 on the
35B-A3B shape: 1 MB of weight) followed by :mod:`.moe_route`'s small kernel, two launches
and their gap in every MoE layer. Here programs ``(token, part)`` each take a slice of the
hidden dimension for all experts (so the weight is read once, by as many SMs as there are
parts, in whichever layout the router is stored), store their partial logits, and the
last part of a token to arrive (an arrival counter, reset after) sums the partials in
part order, rounds the logits to x's dtype as the router's linear layer would, and picks
the experts with :func:`.moe_route.pick_experts`. The shared expert's gate row rides
along as one more row. Results do not depend on timing; they may differ from the two
launches in the last bit of a logit (another summation order), as another matmul kernel's
would.

Opt-in (``NINFER_FUSED_ROUTER=1``), up to :data:`MAX_TOKENS` tokens. Measured on the H200
in session 20 (35B-A3B, batch 8, step profile), it took 20.5 us a layer, against about 9 for
the two launches it replaces (session 7), because few programs each read a long slice
of the weight; until a reshaped kernel wins in whole steps, the two launches stay the default.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.moe_route import moe_route, pick_experts
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: decode batches up to this many tokens take the one launch
MAX_TOKENS = 16
#: hidden columns per part: 16 parts at the 35B-A3B's 2048, each reading 256 x 128 x 2 bytes
PART_H = 128
BLOCK_H = 32


def fused_router() -> bool:
    """``NINFER_FUSED_ROUTER=1`` takes the one launch (read per call); else the router's
    matmul and the routing stay apart."""
    return os.environ.get("NINFER_FUSED_ROUTER", "0") == "1"


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, gate_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr,
    num_experts, hidden, parts, stride_xt, stride_we, stride_wh,
    TOP_K: tl.constexpr, K_OUT: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_KO: tl.constexpr, PART_H: tl.constexpr, BLOCK_H: tl.constexpr,
    ROUND: tl.constexpr, USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < num_experts
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    g_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_PDL:  # x comes from the norm just before
        tl.extra.cuda.gdc_wait()
    for h0 in range(part * PART_H, tl.minimum(part * PART_H + PART_H, hidden), BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        xv = tl.load(x_ptr + t * stride_xt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_h[None, :] * stride_wh,
                    mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], 1)
        if HAS_SHARED:
            g_acc += tl.load(gate_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * xv
    # a token's partials: BLOCK_E logits then the shared gate's, one row per part
    row = part_ptr + (t * parts + part) * (BLOCK_E + 1)
    tl.store(row + offs_e, acc)
    tl.store(row + BLOCK_E, tl.sum(g_acc, 0))
    tl.debug_barrier()  # every thread's partials are stored before the counter moves
    counter = count_ptr + t
    if tl.atomic_add(counter, 1, sem="acq_rel") == parts - 1:
        logits = tl.zeros([BLOCK_E], dtype=tl.float32)
        g = 0.0
        for p in range(0, parts):  # part order: the same sum every time
            prow = part_ptr + (t * parts + p) * (BLOCK_E + 1)
            logits += tl.load(prow + offs_e, cache_modifier=".cg")
            g += tl.load(prow + BLOCK_E, cache_modifier=".cg")
        # rounded to x's dtype as the router's (and the shared gate's) linear layer would
        logits = round_to(logits, x_ptr.dtype.element_ty, ROUND).to(tl.float32)
        logits = tl.where(e_ok, logits, float("-inf"))
        g = round_to(g, x_ptr.dtype.element_ty, ROUND).to(tl.float32)
        pick_experts(logits, e_ok, g, weights_ptr + t * K_OUT, ids_ptr + t * K_OUT, num_experts,
                     TOP_K, K_OUT, RENORM, HAS_SHARED, BLOCK_E, BLOCK_KO)
        tl.store(counter, 0)


def route_tokens(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.moe.route_tokens`: the router ``[E, H]`` (any
    strides) applied to ``x`` [T, H], then :func:`.moe_route.moe_route`; one launch up to
    :data:`MAX_TOKENS` tokens."""
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
    block_e = triton.next_power_of_2(num_experts)
    parts = triton.cdiv(hidden, PART_H)
    weights = torch.empty(num_tokens, k_out, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, k_out, dtype=torch.int32, device=x.device)
    partials = torch.empty(num_tokens * parts * (block_e + 1), dtype=torch.float32, device=x.device)
    counters = counter_buffer("moe_router", x.device, num_tokens, MAX_TOKENS)
    use_pdl = pdl.enabled(x.device)
    _router_kernel[(num_tokens, parts)](
        x, router, gate, partials, counters, weights, ids, num_experts, hidden, parts, x.stride(0),
        router.stride(0), router.stride(1),
        TOP_K=top_k, K_OUT=k_out, RENORM=renormalize, HAS_SHARED=has_shared, BLOCK_E=block_e,
        BLOCK_KO=triton.next_power_of_2(k_out), PART_H=PART_H, BLOCK_H=BLOCK_H, ROUND=interpreted_bf16(x),
        USE_PDL=use_pdl, num_warps=4, **pdl.launch_options(use_pdl),
    )
    return weights, ids
