"""Prefill-sized products of a quantized weight through cuBLAS, two routes.

At thousands of rows a GEMM is bound by the tensor cores, not by the weight's bytes, so
reading fewer bytes buys nothing there; what a format costs is the work inside the
product's inner loop. An 8k-token prefill of the 27B ran at 0.85x its bf16 speed in FP8
and 0.44x in int4 on an H100 with our Triton tiles (session 23), which rebuild every
weight once per row tile. The table (:mod:`.quant_gemm`, ``route``) may send a shape here:

* ``dense`` (every format): the weight dequantized once per call into a bf16/fp16
  scratch, then cuBLAS's product. Hopper has no int4 or FP4 tensor cores, so this is the
  cost of one extra pass over the weight. vLLM takes the same turn for AWQ above 256
  tokens. The scratch is bounded (:data:`SCRATCH_BYTES`): a wider weight is done in
  slices of output columns. Each weight is computed in float32 and rounded once to x's
  dtype, as the formats' ``dequantize`` does.
* ``block_scaled`` (FP8 with 128x128 blocks, sm_90): x quantized per token per 128
  columns as our tensor-core tiles do it (:func:`.quant_tiles.quantize_activations`),
  then torch's ``scaled_mm`` with DeepSeek-style block scales (cuBLAS on Hopper), where
  this torch has it (:func:`block_scaled_available`). Any row count: the sweep offers it
  for decode rows too, where cuBLAS may stream the weight better than our tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton.int4_fp16 import group_zeros
from ninfer_kernels.triton.quant_tiles import quantize_activations
from ninfer_kernels.triton.rounding import e2m1_half, round_to

#: most bytes of dequantized weight held at once (a slice of output columns per multiply)
SCRATCH_BYTES = 256 << 20


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, alpha_ptr, out_ptr, n_begin, N, K, group_n, group_k,
                       stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk,
                       FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND: tl.constexpr):
    """Rows ``n_begin + [0, N)`` of the weight into ``out`` [N, K] (x's dtype)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (offs_k < K)[None, :]
    n = (n_begin + rows).to(tl.int64)[:, None]
    k = offs_k[None, :]
    if FORMAT == 0:  # FP8 block (quant_tiles.FP8): code times its block's scale
        w = tl.load(w_ptr + n * stride_wn + k * stride_wk, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (n // group_n) * stride_sn + (k // group_k) * stride_sk, mask=ok, other=0.0)
        value = w * s
    elif FORMAT == 2:  # int4 (INT4): column 8w + j is nibble j of word w
        words = tl.load(w_ptr + n * stride_wn + (k // 8) * stride_wk, mask=ok, other=0)
        q = ((words >> ((k % 8) * 4)) & 0xF).to(tl.float32)
        g = k // group_k
        s = tl.load(s_ptr + n * stride_sn + g * stride_sk, mask=ok, other=0.0).to(tl.float32)
        z = group_zeros(z_ptr + n * stride_zn + g * stride_zk, ok)
        value = (q - z) * s
    else:  # NVFP4: low nibble column 2i, high 2i + 1; e4m3 scale per 16 columns; alpha
        pair = tl.load(w_ptr + n * stride_wn + (k // 2) * stride_wk, mask=ok, other=0).to(tl.int32)
        code = (pair >> ((k % 2) * 4)) & 0xF
        s = tl.load(s_ptr + n * stride_sn + (k // 16) * stride_sk, mask=ok, other=0.0).to(tl.float32)
        value = e2m1_half(code).to(tl.float32) * s * tl.load(alpha_ptr)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + k, round_to(value, out_ptr.dtype.element_ty, ROUND), mask=ok)


def _launch(weight: qf.QuantWeight, out: torch.Tensor, n_begin: int) -> None:
    from ninfer_kernels.triton.quant_gemm import operands, zero_args  # quant_gemm imports this module
    op = operands(weight)
    rows, k = out.shape
    block_n, block_k = 32, 128
    _dequantize_kernel[(triton.cdiv(rows, block_n), triton.cdiv(k, block_k))](
        op.data, op.scale, *zero_args(op), op.alpha, out, n_begin, rows, k, op.group_n, op.group_k, *op.strides(),
        FORMAT=op.fmt, BLOCK_N=block_n, BLOCK_K=block_k,
        ROUND=out.device.type != "cuda" and out.dtype == torch.bfloat16, num_warps=4)


def dequantize(weight: qf.QuantWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole 2-D weight [N, K] in ``dtype`` (for probes and tests; the product below
    never holds more than a slice)."""
    n, k = weight.shape
    device = next(t for t in vars(weight).values() if isinstance(t, torch.Tensor)).device
    out = torch.empty(n, k, dtype=dtype, device=device)
    _launch(weight, out, 0)
    return out


def slice_rows(n: int, k: int, itemsize: int) -> int:
    """Output columns per multiply so that their weights fit :data:`SCRATCH_BYTES`
    (a multiple of 128, at least 128)."""
    fit = max(128, SCRATCH_BYTES // max(1, k * itemsize) // 128 * 128)
    return min(n, fit)


def dense_matmul(x: torch.Tensor, weight: qf.QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` for x [M, K]: W dequantized to x's dtype a slice at a time, each
    slice multiplied by cuBLAS (through torch, the bias added in its epilogue)."""
    n, k = weight.shape
    step = slice_rows(n, k, x.element_size())
    scratch = torch.empty(step, k, dtype=x.dtype, device=x.device)
    out = None if step == n else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, step):
        part = scratch[:min(step, n - n0)]
        _launch(weight, part, n0)
        cols = slice(n0, n0 + part.shape[0])
        y = x @ part.t() if bias is None else torch.addmm(bias[cols], x, part.t())
        if out is None:  # one slice: its product is the output
            return y
        out[:, cols] = y
    return out


def block_scaled_available(x: torch.Tensor, weight: qf.QuantWeight) -> bool:
    """Whether :func:`block_scaled_matmul` serves x and this weight: an FP8 weight in 128x128
    blocks, K whole groups of four blocks (cuBLAS reads the scales in fours), N whole
    16-byte rows of the output, codes and scales row-major as loaded, on an sm_90 device,
    in a torch with block-scaled ``scaled_mm`` (cuBLAS restricts these recipes to Hopper).
    N need not be whole blocks: the fused in_proj_qkvz + ba (N = 16,480, a last block of
    96 rows) ran there in torch 2.11 with the error of the other FP8 routes (session 24)."""
    f = torch.nn.functional
    n, k = weight.shape[-2:]
    return (isinstance(weight, qf.Fp8Block) and tuple(weight.block) == (128, 128) and n % 16 == 0 and k % 512 == 0
            and weight.weight.is_contiguous() and weight.scale.is_contiguous() and x.device.type == "cuda"
            and torch.cuda.get_device_capability(x.device) == (9, 0)
            and hasattr(f, "scaled_mm") and hasattr(getattr(f, "ScalingType", None), "BlockWise128x128"))


def block_scaled_matmul(x: torch.Tensor, weight: qf.Fp8Block, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` on the FP8 tensor cores through cuBLAS: x's e4m3 codes and scales
    per token per 128 columns, W's per 128 x 128 block. cuBLAS wants the row count a
    multiple of 4 (x padded with zero rows) and x's scales column-major."""
    f = torch.nn.functional
    rows = x.shape[0]
    if rows % 4:
        x = f.pad(x, (0, 0, 0, -rows % 4))
    codes, scales = quantize_activations(x.contiguous())
    out = f.scaled_mm(codes, weight.weight.t(), scales.t().contiguous().t(), f.ScalingType.BlockWise1x128,
                      weight.scale.t(), f.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:rows]
    if bias is not None:
        out += bias
    return out

