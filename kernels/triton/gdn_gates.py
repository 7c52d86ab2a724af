"""Gated DeltaNet's per-token gates in one launch instead of about seven torch ops.

A prefill chunk's ``a`` and ``b`` are two narrow column slices of the input projection
([T, Hv] each, read in place). Per token and value head: ``g = -exp(A_log) *
softplus(a + dt_bias)`` in float32 (softplus with torch's threshold of 20, as the decode
kernel computes it) and ``beta = sigmoid(b)`` rounded to ``b``'s dtype. The reference is
:func:`ninfer_kernels.gated_delta.gdn_gates`; ``exp`` and ``log`` are the GPU's, so ``g``
can differ from torch's in its last bits (torch's ``log1p`` keeps more of a tiny
``exp(a)``, where the decay it sets is 1 to float32 either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: tokens a program takes
BLOCK_T = 64


@triton.jit(do_not_specialize=["tokens"])  # one variant for every chunk length
def _gdn_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, stride_a, stride_b,
                      H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, ROUND: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    mask = (t < tokens)[:, None] & h_ok[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_a + h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_b + h[None, :], mask=mask, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(a_log_ptr + h, mask=h_ok, other=0.0).to(tl.float32))
    x = a + tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    g = neg_a[None, :] * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    beta = 1.0 / (1.0 + tl.exp(-b))
    out = t[:, None] * H + h[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, round_to(beta, beta_ptr.dtype.element_ty, ROUND), mask=mask)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: ``(g float32 [T, Hv], beta [T, Hv] in b's dtype)``."""
    tokens, heads = a.shape
    if a.stride(1) != 1 or b.stride(1) != 1:
        a, b = a.contiguous(), b.contiguous()
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        _gdn_gates_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            a, b, a_log, dt_bias, g, beta, tokens, a.stride(0), b.stride(0),
            H=heads, BLOCK_H=triton.next_power_of_2(heads), BLOCK_T=BLOCK_T, ROUND=interpreted_bf16(b),
        )
    return g, beta
