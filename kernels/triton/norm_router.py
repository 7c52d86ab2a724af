"""A MoE block's input norm and its router's matmul in one launch (decode batches).

At one token a MoE layer of the 35B-A3B is a chain of short launches: the residual add
and RMSNorm, the router's matmul (256 x 2,048: 1 MB), the routing, the experts' gate/up
and down. Each link costs its launch's start and its wait for the one before more than
its bytes (docs/moe.md). Here every program of a grid (token, block of router rows)
does the add and the norm of its token itself (4 KB each from x and the residual, read
through L2 by every program) and the dot products of its ``BLOCK_E`` router rows; the
first block's programs store the normalised row and the new residual. So the norm's
launch and the router's are one, with no program waiting on another.

With a shared expert the last block's programs also take its gate row, whose logit
(rounded to the model dtype, as its linear layer would) goes to column ``E``: the routing
kernel after reads it from the logits (``gate_in_logits``) and so reads nothing this
launch wrote before its own wait.

The router rows and the norm weight are never what the kernel before wrote: under PDL
they are read before the wait, overlapping the end of the projection before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.norm import NORM_ROUTER_MAX_TOKENS as MAX_TOKENS
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: router rows a program takes (the 35B-A3B's 256 experts: 64 programs a token); a router
#: laid out column-major (CUDA models' layout for cuBLAS, which the MoE blocks no longer give
#: their routers: that read measured slower, docs/moe.md) takes 16, so that a block's values
#: at one hidden index fill a 32-byte sector (16 programs a token)
BLOCK_E = 4
BLOCK_E_COLUMN_MAJOR = 16


@triton.jit
def _norm_router_kernel(
    x_ptr, res_ptr, w_ptr, router_ptr, gate_ptr, out_ptr, sum_ptr, logits_ptr,
    num_experts, eps, stride_x, stride_r, stride_re, stride_rh, stride_l,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, HAS_GATE: tl.constexpr, USE_PDL: tl.constexpr,
    ROUND: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    c_ok = cols < N
    e = block * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    rows = router_ptr + e.to(tl.int64)[:, None] * stride_re + cols[None, :].to(tl.int64) * stride_rh
    wr = tl.load(rows, mask=e_ok[:, None] & c_ok[None, :], other=0.0)
    # the last block also takes the shared expert's gate row (a pointer select into the
    # router's tile would hide the rows' contiguity from Triton and split every load)
    last_block = tl.num_programs(1) - 1
    if HAS_GATE:  # (the flag broadcast to a vector: the interpreter rejects scalar-and-block masks)
        g = tl.load(gate_ptr + cols, mask=c_ok & ((cols * 0 + block) == last_block), other=0.0)
    if USE_PDL:
        pdl.wait()  # x comes from the projection just before
    x = tl.load(x_ptr + t * stride_x + cols, mask=c_ok, other=0.0)
    res = tl.load(res_ptr + t * stride_r + cols, mask=c_ok, other=0.0)
    # as the norm kernel: the sum rounded to the residual stream's dtype, the norm in float32
    s = round_to(x.to(tl.float32) + res.to(tl.float32), sum_ptr.dtype.element_ty, ROUND)
    sf = s.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / N + eps)
    out = round_to(sf * inv_rms * w, out_ptr.dtype.element_ty, ROUND)
    if block == 0:
        tl.store(sum_ptr + t * N + cols, s, mask=c_ok)
        tl.store(out_ptr + t * N + cols, out, mask=c_ok)
    of = out.to(tl.float32)
    logits = tl.sum(of[None, :] * wr.to(tl.float32), 1)
    tl.store(logits_ptr + t * stride_l + e, round_to(logits, logits_ptr.dtype.element_ty, ROUND), mask=e_ok)
    if HAS_GATE:
        if block == last_block:
            gate = tl.sum(of * g.to(tl.float32), 0)
            tl.store(logits_ptr + t * stride_l + num_experts, round_to(gate, logits_ptr.dtype.element_ty, ROUND))


def rms_norm_router(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.norm.rms_norm_router` (x and residual [T, H],
    T at most :data:`MAX_TOKENS`)."""
    tokens, n = x.shape
    if tokens > MAX_TOKENS:
        raise ValueError(f"rms_norm_router serves decode batches of up to {MAX_TOKENS} tokens, got {tokens}")
    if residual.shape != x.shape or router.shape[1] != n:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and router {tuple(router.shape)} "
                         "must share the hidden size")
    x, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    dtype = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(tokens, n, dtype=dtype, device=x.device)
    new_residual = torch.empty_like(out)
    num_experts = router.shape[0]
    has_gate = shared_gate is not None
    logits = torch.empty(tokens, num_experts + has_gate, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out, new_residual, logits
    gate = shared_gate.reshape(-1).contiguous() if has_gate else router
    use_pdl = pdl.enabled(x.device)
    column_major = router.stride(1) != 1
    block_e = BLOCK_E_COLUMN_MAJOR if column_major else BLOCK_E
    _norm_router_kernel[(tokens, triton.cdiv(num_experts, block_e))](
        x, residual, weight.contiguous(), router, gate, out, new_residual, logits,
        num_experts, eps, x.stride(0), residual.stride(0), router.stride(0), router.stride(1), logits.stride(0),
        N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_E=block_e, HAS_GATE=has_gate, USE_PDL=use_pdl,
        ROUND=interpreted_bf16(x), num_warps=8 if column_major else 4, **pdl.launch_options(use_pdl),
    )
    return out, new_residual, logits
