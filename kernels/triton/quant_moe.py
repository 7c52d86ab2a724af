"""Fused mixture-of-experts on CUDA for quantized expert weights (FP8 block, int4, NVFP4).

The same plan as :mod:`.fused_moe`, whose routing layout, program-to-rows mapping and
final per-token sum this module reuses: :func:`.moe_route.moe_align` sorts the pairs by
expert (a single token skips it: one pair per block), a gate_up kernel stores
``silu(gate) * up`` per pair, a down kernel the pair's weighted down projection, and
:func:`.fused_moe.sum_pairs` adds each token's rows. Only the tile loops differ: they are
:func:`.quant_tiles.quant_tile`, which dequantizes the expert's weight as it streams it.
``w13`` [E, 2I, H] and ``w2`` [E, H, I] carry a leading expert dimension in every
component (data, scales, zeros; NVFP4's ``alpha`` is [E] or one for all).

FP8 at prefill sizes quantizes the activations per token per 128 columns and multiplies
on the FP8 tensor cores (the intermediate is quantized again before the down GEMM);
fewer rows per expert run weight-only, as does every int4 / NVFP4 call. A single token's
FP8 and int4 pairs take the one-row steps of :mod:`.fp8_gemv` and :mod:`.int4_fp16` (one
pair a program) where their conditions hold (:func:`_packed`).

The shared expert (id E) in the experts' format takes the same kernels through its own
pointers; one left in bf16 beside quantized experts runs through :mod:`.fused_moe` as a
one-expert call and is added in float32. Shapes come from :mod:`.quant_moe_shapes` (a
tuned table, else the bf16 heuristic's row blocks with each format's K step), or the
caller's ``config``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import fused_moe as bf16_moe
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.fp8_gemv import STEP_SCALE, fp8_gemv_row, fp8_gemv_two, uniform_scale
from ninfer_kernels.triton.fused_moe import _layout_args, _rows_of, finish_pairs
from ninfer_kernels.triton.int4_fp16 import int4_gemv_row
from ninfer_kernels.triton.moe_route import moe_align
from ninfer_kernels.triton.moe_shapes import GemmConfig
from ninfer_kernels.triton.quant_gemm import Operands, block_k_for, operands, packed_flags, zero_args
from ninfer_kernels.triton.quant_moe_shapes import QuantMoeConfig, quant_moe_config
from ninfer_kernels.triton.quant_tiles import (
    FP8, FP8_ACT, INT4_MAGIC, NVFP4, half_products, quant_tile, quantize_activations,
)
from ninfer_kernels.triton.rounding import round_to


@triton.jit
def _expert_operands(expert, shared_id, w_ptr, s_ptr, z_ptr, alpha_ptr, sw_ptr, ss_ptr, sz_ptr, salpha_ptr,
                     stride_we, stride_se, stride_ze, stride_ae, HAS_SHARED: tl.constexpr):
    """Base pointers of ``expert``'s matrix: the routed experts' slices, or the shared expert's own."""
    e = expert.to(tl.int64)
    w, s, z, alpha = w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_ze, alpha_ptr + e * stride_ae
    if HAS_SHARED:
        if expert == shared_id:
            w, s, z, alpha = sw_ptr, ss_ptr, sz_ptr, salpha_ptr
    return w, s, z, alpha


# group_n and group_k are compile-time, as in .quant_gemm's kernel (no division a K step)
@triton.jit(do_not_specialize=["pairs", "max_rows"])
def _quant_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, alpha_ptr, sw_ptr, ss_ptr, sz_ptr, salpha_ptr, out_ptr,
    sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
    pairs, max_rows, top_k, shared_id, N, K, group_n: tl.constexpr, group_k: tl.constexpr,
    stride_xt, stride_xk, stride_xst, stride_we, stride_se, stride_ze, stride_ae,
    stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, stride_ot,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_SHARED: tl.constexpr, PER_PAIR: tl.constexpr, MAGIC: tl.constexpr,
    OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr, HALF: tl.constexpr, PACKED: tl.constexpr = False, X_BF16: tl.constexpr = True,
    EVEN_K: tl.constexpr = False, FP8_SCALE: tl.constexpr = 0, EMULATE: tl.constexpr = False,
    PAIRS: tl.constexpr = False, STAGED: tl.constexpr = 0, JOINT: tl.constexpr = False,
):
    if USE_PDL:  # the routing (or the layout) comes from the kernel just before
        pdl.wait()
    expert, pair, pid_n = _rows_of(tl.program_id(0), sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
                                   max_rows, N, BLOCK_M, BLOCK_N, GROUP_M, PER_PAIR)
    if expert == -1:
        return
    row_ok = pair < pairs  # the sentinel P pads each run
    token = pair // top_k
    w, s, z, alpha = _expert_operands(expert, shared_id, w_ptr, s_ptr, z_ptr, alpha_ptr, sw_ptr, ss_ptr, sz_ptr,
                                      salpha_ptr, stride_we, stride_se, stride_ze, stride_ae, HAS_SHARED)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_rows, as_rows = x_ptr + token * stride_xt, xs_ptr + token * stride_xst
    if PACKED and FORMAT != 0:  # one token, int4: gate and up rows as one tile of the one-row step
        # (per-row scales, so the rows need not be neighbours): x is converted once for
        # both, and one pipeline of word loads feeds both
        rows = tl.reshape(tl.join(offs_n, offs_n + N), [2 * BLOCK_N])  # gate and up rows alternating
        rows_ok = tl.reshape(tl.join(n_ok, n_ok), [2 * BLOCK_N])
        both = int4_gemv_row(x_ptr + tl.max(token, 0) * stride_xt, w, s, z, rows, rows_ok, 0, K, stride_wn,
                             stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k, 2 * BLOCK_N, BLOCK_K,
                             X_BF16, EVEN_K, EMULATE, STAGED=STAGED)
        gate, up = tl.split(tl.reshape(both, [1, BLOCK_N, 2]))
    elif PACKED and JOINT:  # one token, FP8, gate and up rows in one loop of STAGED stages
        gate, up = fp8_gemv_two(x_ptr + tl.max(token, 0) * stride_xt, w, s, offs_n, offs_n + N, n_ok, K, stride_wn,
                                stride_sn, stride_sk, group_n, group_k, BLOCK_N, BLOCK_K, FP8_SCALE, X_BF16, EVEN_K,
                                EMULATE, STAGED)
    elif PACKED:  # one token, FP8: a block scale may differ between the gate and up rows
        x_row = x_ptr + tl.max(token, 0) * stride_xt
        gate = _packed_row(x_row, w, s, z, offs_n, n_ok, K, stride_wn, stride_wk, stride_sn, stride_sk,
                           stride_zn, stride_zk, group_n, group_k, FORMAT, BLOCK_N, BLOCK_K, X_BF16, EVEN_K,
                           FP8_SCALE, EMULATE, STAGED)
        up = _packed_row(x_row, w, s, z, offs_n + N, n_ok, K, stride_wn, stride_wk, stride_sn, stride_sk,
                         stride_zn, stride_zk, group_n, group_k, FORMAT, BLOCK_N, BLOCK_K, X_BF16, EVEN_K,
                         FP8_SCALE, EMULATE, STAGED)
    else:
        gate, up = _gate_up_tiles(a_rows, as_rows, row_ok, stride_xk, w, s, z, offs_n, n_ok, N, K,
                                  stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                                  FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST, HALF,
                                  PAIRS)
    if FORMAT == 3:  # NVFP4's one factor
        gate *= tl.load(alpha)
        up *= tl.load(alpha)
    h = gate / (1.0 + tl.exp(-gate)) * up
    dest = out_ptr + pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(dest, round_to(h, out_ptr.dtype.element_ty, ROUND), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_tiles(a_rows, as_rows, row_ok, stride_xk, w, s, z, offs_n, n_ok, N, K,
                   stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                   FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   MAGIC: tl.constexpr, OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr,
                   UPCAST: tl.constexpr, HALF: tl.constexpr, PAIRS: tl.constexpr):
    gate = quant_tile(a_rows, as_rows, row_ok, stride_xk, w, s, z, offs_n, n_ok, 0, K,
                      stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                      FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST, HALF=HALF,
                      PAIRS=PAIRS)
    up = quant_tile(a_rows, as_rows, row_ok, stride_xk, w, s, z, offs_n + N, n_ok, 0, K,
                    stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                    FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST, HALF=HALF,
                    PAIRS=PAIRS)
    return gate, up


@triton.jit
def _packed_row(x_row, w, s, z, offs_n, n_ok, K, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk,
                group_n, group_k, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                X_BF16: tl.constexpr, EVEN_K: tl.constexpr, FP8_SCALE: tl.constexpr, EMULATE: tl.constexpr,
                STAGED: tl.constexpr):
    """[1, BLOCK_N] of one row of x against rows ``offs_n`` of an FP8 or int4 expert."""
    if FORMAT == 0:
        out = fp8_gemv_row(x_row, w, s, offs_n, n_ok, 0, K, stride_wn, stride_sn, stride_sk, group_n, group_k,
                           BLOCK_N, BLOCK_K, FP8_SCALE, X_BF16, EVEN_K, EMULATE, STAGED=STAGED)
    else:
        out = int4_gemv_row(x_row, w, s, z, offs_n, n_ok, 0, K, stride_wn, stride_wk, stride_sn, stride_sk,
                            stride_zn, stride_zk, group_k, BLOCK_N, BLOCK_K, X_BF16, EVEN_K, EMULATE, STAGED=STAGED)
    return out


@triton.jit(do_not_specialize=["pairs", "max_rows"])
def _quant_down_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, z_ptr, alpha_ptr, sw_ptr, ss_ptr, sz_ptr, salpha_ptr, out_ptr, weights_ptr,
    sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
    pairs, max_rows, shared_id, N, K, group_n: tl.constexpr, group_k: tl.constexpr,
    stride_at, stride_ak, stride_ast, stride_we, stride_se, stride_ze, stride_ae,
    stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, stride_ot,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_SHARED: tl.constexpr, PER_PAIR: tl.constexpr, MAGIC: tl.constexpr,
    OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr, HALF: tl.constexpr, PACKED: tl.constexpr = False, X_BF16: tl.constexpr = True,
    EVEN_K: tl.constexpr = False, FP8_SCALE: tl.constexpr = 0, EMULATE: tl.constexpr = False,
    PAIRS: tl.constexpr = False, STAGED: tl.constexpr = 0,
):
    if USE_PDL:
        pdl.wait()
    expert, pair, pid_n = _rows_of(tl.program_id(0), sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
                                   max_rows, N, BLOCK_M, BLOCK_N, GROUP_M, PER_PAIR)
    if expert == -1:
        return
    row_ok = pair < pairs
    w, s, z, alpha = _expert_operands(expert, shared_id, w_ptr, s_ptr, z_ptr, alpha_ptr, sw_ptr, ss_ptr, sz_ptr,
                                      salpha_ptr, stride_we, stride_se, stride_ze, stride_ae, HAS_SHARED)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PACKED:
        acc = _packed_row(a_ptr + tl.max(pair, 0) * stride_at, w, s, z, offs_n, n_ok, K, stride_wn, stride_wk,
                          stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k, FORMAT, BLOCK_N, BLOCK_K,
                          X_BF16, EVEN_K, FP8_SCALE, EMULATE, STAGED)
    else:
        acc = quant_tile(a_ptr + pair * stride_at, as_ptr + pair * stride_ast, row_ok, stride_ak, w, s, z, offs_n,
                         n_ok, 0, K, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n,
                         group_k, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST,
                         HALF=HALF, PAIRS=PAIRS)
    if FORMAT == 3:
        acc *= tl.load(alpha)
    acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    dest = out_ptr + pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(dest, round_to(acc, out_ptr.dtype.element_ty, ROUND), mask=row_ok[:, None] & n_ok[None, :])


# -- host ---------------------------------------------------------------------------------------
def _contiguous(op: Operands) -> Operands:
    """Every component contiguous: routed and shared matrices then share their strides."""
    return replace(op, data=op.data.contiguous(), scale=op.scale.contiguous(), zeros=op.zeros.contiguous())


def _expert_strides(op: Operands) -> tuple[int, int, int, int]:
    """Strides between experts of data, scales, zeros and alpha (0: one alpha for all)."""
    return op.data.stride(0), op.scale.stride(0), op.zeros.stride(0), 1 if op.alpha.numel() > 1 else 0


def _launch(kernel, a, a_scales, op: Operands, shared: Operands | None, out, extra: tuple, align, pair_ids,
            pairs: int, width: int, block_m: int, cfg: GemmConfig, fmt: int, fit, scalars: tuple, row_strides: tuple,
            staged: int = 0, joint: bool = False):
    """One grouped quantized GEMM: ``width`` output columns per pair, rows of ``a``. A single
    token's one-row steps stage their words through shared memory with ``staged`` stages,
    and with ``joint`` (gate_up, FP8, at least 2 stages) read gate and up rows in one loop."""
    block_n = min(cfg.BLOCK_N, max(16, triton.next_power_of_2(width)))
    packed = _packed(a, op, shared, align, fmt, fit, block_n, width)
    if packed["PACKED"]:
        block_m = 1  # one pair a program
        packed["STAGED"] = staged
        if joint and fmt == FP8 and staged >= 2:
            packed["JOINT"] = True
    grid, layout, max_rows = _layout_args(align, pair_ids, pairs, block_m, width, block_n)
    s = shared if shared is not None else op
    magic, offset = INT4_MAGIC[out.dtype]  # x's dtype (``a`` is e4m3 on the FP8 tensor-core path)
    use_pdl = pdl.enabled(out.device)
    on_cpu = out.device.type != "cuda"
    zeros, shared_zeros = zero_args(op, s)
    kernel[grid](
        a, a_scales, op.data, op.scale, zeros, op.alpha, s.data, s.scale, shared_zeros, s.alpha, out, *extra, *layout,
        pairs, max_rows, *scalars, op.group_n, op.group_k,
        *row_strides, *_expert_strides(op), *op.strides(), out.stride(0),
        FORMAT=fmt, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=fit[0], GROUP_M=cfg.GROUP_M,
        HAS_SHARED=shared is not None, PER_PAIR=align is None, MAGIC=magic, OFFSET=offset, SCALE_PER_ELEMENT=fit[1],
        UPCAST=on_cpu, ROUND=on_cpu and out.dtype == torch.bfloat16, USE_PDL=use_pdl,
        HALF=fmt in (FP8, NVFP4) and half_products(out),  # out has x's dtype
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(use_pdl), **packed,
    )


def _packed(a, op: Operands, shared: Operands | None, align, fmt: int, fit, block_n: int, width: int) -> dict:
    """:func:`.quant_gemm.packed_flags` for one grouped GEMM: a single token's pairs (no
    layout, ``align`` None) take the one-row steps, one pair a program; an FP8 block scale
    must also be uniform over the up half's rows, which start ``width`` rows in."""
    scale = uniform_scale((op.group_n, op.group_k), block_n, op.k) if fmt == FP8 else 0
    if scale == STEP_SCALE and width % op.group_n:
        scale = 0
    weights = [op] + ([shared] if shared is not None else [])
    return packed_flags(a, weights, fmt, align is None, fit[1], scale, fit[0])


def quant_fused_moe(x: torch.Tensor, w13: qf.QuantWeight, w2: qf.QuantWeight, weights: torch.Tensor,
                    ids: torch.Tensor, shared13=None, shared2=None, config: QuantMoeConfig | None = None,
                    summed: bool = True) -> torch.Tensor:
    """:func:`ninfer_kernels.moe.fused_moe`'s contract for quantized ``w13``/``w2`` (and
    shared expert weights, quantized alike or plain tensors)."""
    if (shared2 is None) != (shared13 is None):
        raise ValueError("give both shared13 and shared2, or neither")
    if shared13 is not None and isinstance(shared13, torch.Tensor):
        return _plain_shared_expert(x, w13, w2, weights, ids, shared13, shared2, config, summed)
    op13, op2 = _contiguous(operands(w13)), _contiguous(operands(w2))
    num_experts = op13.data.shape[0]
    top_k = ids.shape[1]
    has_shared = shared13 is not None
    s13 = _contiguous(operands(shared13)) if has_shared else None
    s2 = _contiguous(operands(shared2)) if has_shared else None
    if op13.fmt != op2.fmt or x.dtype not in INT4_MAGIC or (has_shared and s13.fmt != op13.fmt):
        return _dequantized(x, w13, w2, weights, ids, shared13, shared2, summed)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.empty_like(x) if summed else x.new_empty(0, top_k, op2.n)
    config = config or quant_moe_config(op13.fmt, num_experts + has_shared, top_k, num_tokens, op13.tag, op2.n,
                                        op13.n // 2, x.device, x.dtype)
    fmt = FP8_ACT if op13.fmt == FP8 and config.act_quant else op13.fmt
    fit13 = block_k_for(op13, fmt, config.gate_up.BLOCK_K)
    fit2 = block_k_for(op2, fmt, config.down.BLOCK_K)
    if fit13 is None or fit2 is None:
        return _dequantized(x, w13, w2, weights, ids, shared13, shared2, summed)
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    weights = weights.float().contiguous()
    pairs, inter, hidden = num_tokens * top_k, op13.n // 2, op2.n
    align = moe_align(ids, num_experts + has_shared, config.block_m) if num_tokens > 1 else None
    a, a_scales = quantize_activations(x.contiguous()) if fmt == FP8_ACT else (x, x)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _launch(_quant_gate_up_kernel, a, a_scales, op13, s13, h, (), align, ids, pairs, inter, config.block_m,
            config.gate_up, fmt, fit13, (top_k, num_experts, inter, op13.k),
            (a.stride(0), a.stride(1), a_scales.stride(0)), staged=config.gate_up_staged, joint=config.joint)
    hq, hq_scales = quantize_activations(h) if fmt == FP8_ACT else (h, h)
    rows = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(_quant_down_kernel, hq, hq_scales, op2, s2, rows, (weights,), align, ids, pairs, hidden,
            config.block_m, config.down, fmt, fit2, (num_experts, hidden, op2.k),
            (hq.stride(0), hq.stride(1), hq_scales.stride(0)), staged=config.down_staged)
    return finish_pairs(rows, num_tokens, top_k, summed)


def _dequantized(x, w13, w2, weights, ids, shared13, shared2, summed=True) -> torch.Tensor:
    """What no kernel here covers (float32 x, mixed formats, odd groupings): the bf16 path
    on dequantized copies. Slow and memory-hungry; correct."""
    def plain(w):
        return w if w is None or isinstance(w, torch.Tensor) else w.dequantize(x.dtype)
    return bf16_moe.fused_moe(x, plain(w13), plain(w2), weights, ids, plain(shared13), plain(shared2), summed=summed)


def _plain_shared_expert(x, w13, w2, weights, ids, shared13, shared2, config, summed=True) -> torch.Tensor:
    """Quantized routed experts beside a bf16 shared expert (the last id column): each
    through its own kernels, their rows side by side, summed in float32 and rounded once
    (unless not ``summed``), as every other path does."""
    routed = quant_fused_moe(x, w13, w2, weights[:, :-1], ids[:, :-1].contiguous(), None, None, config,
                             summed=False)
    one = torch.zeros_like(ids[:, -1:], dtype=torch.int32)
    shared = bf16_moe.fused_moe(x, shared13[None], shared2[None], weights[:, -1:], one, summed=False)
    rows = torch.cat([routed, shared], dim=1)
    return finish_pairs(rows.view(-1, rows.shape[-1]), rows.shape[0], rows.shape[1], summed)
