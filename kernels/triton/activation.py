"""SwiGLU gate in Triton: ``silu(gate) * up`` read from one fused [gate | up] tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    if USE_PDL:
        pdl.wait()  # the gate/up product comes from the kernel before
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`ninfer_kernels.activation.silu_and_mul`: [..., 2I] -> [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate | up), got {x.shape[-1]}")
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or width == 0:
        return out
    use_pdl = pdl.enabled(x.device)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, BLOCK))](
        x2, out, width, x2.stride(0), BLOCK=BLOCK, USE_PDL=use_pdl, num_warps=4, **pdl.launch_options(use_pdl)
    )
    return out
