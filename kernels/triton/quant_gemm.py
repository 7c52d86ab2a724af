"""``y = x W^T (+ b)`` on CUDA for a weight in one of :mod:`ninfer_kernels.quant_formats`' layouts.

One kernel for all three formats (the per-format inner loop is :func:`.quant_tiles.quant_tile`):
a program owns a ``BLOCK_M x BLOCK_N`` output tile and one of ``SPLITS`` equal parts of K.

* Decode (a few rows) only streams the weight, so what matters is that every SM streams:
  a 16-row tile (rows past M masked; the weight is read once whatever M is), narrow
  column tiles, and split-K when the column tiles alone leave SMs idle (a 5120-wide
  output at 64 columns a program is 80 programs for 132 SMs). The parts' float32 sums
  are added in part order by the part that arrives last for a tile (an arrival counter,
  reset after), as in :mod:`.skinny_linear`: results do not depend on timing. FP8 runs
  weight-only (e4m3 -> bf16 is exact, and x keeps its precision) or on the FP8 tensor
  cores with x quantized inside each K step; either way optionally with the operands
  swapped (``swap``: the weight tile fills the MMA's wide side). FP8 and int4 also have a
  ``gemv`` variant for one to four rows: no ``tl.dot`` (no 16-row padding, no operand
  layout shuffles), float32 products summed elementwise; at one row a program reads
  the weight as 32-bit words instead (:mod:`.fp8_gemv`, :mod:`.int4_fp16`). The table
  picks what measured fastest per shape and row count. int4 at one to eight rows goes to
  :mod:`.int4_mma` (the tensor cores, from the same words) before any of this; FP8 goes
  to :mod:`.fp8_mma` where a table entry's ``route`` is ``mma`` (the tune offers it), or
  always with ``NINFER_FP8_MMA=1``.
* Prefill: bigger tiles, no split. FP8 quantizes x per token per 128 columns first
  (:func:`.quant_tiles.quantize_activations`) and multiplies e4m3 x e4m3 on the tensor
  cores (``act_quant``); int4 and NVFP4 (Hopper has no FP4 tensor cores) dequantize
  in registers and multiply in bf16/fp16. A config's ``route`` may hand the product to
  cuBLAS instead (:mod:`.cublas_prefill`: the weight dequantized once per call, or FP8
  on block-scaled cuBLAS); the heuristic does so for int4 and NVFP4 from
  :data:`DENSE_ROWS` rows.

The launch shape comes from :mod:`.quant_launch` (a per-device tuned table, else a
heuristic).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer_kernels import quant_formats as qf
from ninfer_kernels.triton import cublas_prefill, fp8_mma, int4_mma, pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.fused_moe import _block_of
from ninfer_kernels.triton.fp8_gemv import fp8_gemv_row, uniform_scale
from ninfer_kernels.triton.int4_fp16 import int4_gemv_row
from ninfer_kernels.triton.quant_tiles import (
    ACT_GROUP, FP8, FP8_ACT, FP8_ACT_INLINE, INT4, INT4_MAGIC, NVFP4, half_products, quant_gemv_tile, quant_tile,
    quantize_activations,
)
from ninfer_kernels.triton.quant_launch import (  # noqa: F401 (the launch shapes, re-exported for callers)
    DECODE_ROWS, DENSE_ROWS, NEAR_N, QuantGemmConfig, choose_config, heuristic_config, k_parts_to_fill,
    load_table, sm_count, table_entries, table_key, tuned_entries,
)
from ninfer_kernels.triton.rounding import round_to


@dataclass(frozen=True)
class Operands:
    """A quantized weight as kernel arguments: data, scales, zeros and alpha (dummies where
    the format has none), the K grouping, and the [.., N, K] it stands for."""

    fmt: int
    data: torch.Tensor
    scale: torch.Tensor
    zeros: torch.Tensor
    alpha: torch.Tensor
    group_n: int
    group_k: int
    n: int
    k: int
    tag: str
    symmetric: bool = False  # int4 with every zero point 8

    def strides(self) -> tuple[int, ...]:
        """(data, scale, zeros) strides over the last two dims: n then k, each."""
        return (*self.data.stride()[-2:], *self.scale.stride()[-2:], *self.zeros.stride()[-2:])


def zero_args(*ops: Operands) -> list[torch.Tensor]:
    """What the kernels get as each weight's zero points: its zeros, or, when every weight
    of the launch is symmetric, its own int32 words, which tell the kernels the zero point
    is 8 without reading any (:func:`.int4_fp16.group_zeros`). One launch's weights must
    agree: the kernel picks one of their pointers at run time (routed or shared expert)."""
    if all(op.symmetric for op in ops):
        return [op.data for op in ops]
    return [op.zeros for op in ops]


def operands(w: qf.QuantWeight) -> Operands:
    n, k = w.shape[-2:]
    if isinstance(w, qf.Fp8Block):
        bn, bk = w.block
        return Operands(FP8, w.weight, w.scale, w.scale, w.scale, bn, bk, n, k, f"fp8b{bn}x{bk}")
    if isinstance(w, qf.Int4Group):
        g = w.group_size
        return Operands(INT4, w.qweight, w.scales, w.zeros, w.scales, 1, g, n, k, f"int4g{g}", w.symmetric)
    if isinstance(w, qf.Nvfp4):
        alpha = w.alpha.float().reshape(-1).contiguous()
        return Operands(NVFP4, w.packed, w.scale, w.scale, alpha, 1, 16, n, k, "nvfp4")
    raise TypeError(f"not a quantized weight layout: {type(w).__name__}")


def block_k_for(op: Operands, fmt: int, wanted: int) -> tuple[int, bool] | None:
    """(BLOCK_K, SCALE_PER_ELEMENT) that keep every K step inside one scale group, or None
    (no kernel for this grouping: the reference serves it)."""
    one_group = op.group_k >= op.k
    if fmt in (FP8, FP8_ACT):
        bk = min(wanted, ACT_GROUP) if fmt == FP8_ACT else wanted
        while bk >= 16 and not (one_group or op.group_k % bk == 0):
            bk //= 2
        return (bk, False) if bk >= 16 else None
    if fmt == INT4:  # 8 nibble dots of BLOCK_K / 8 >= 16 columns each
        bk = max(wanted, 128)
        while bk >= 128 and not (one_group or op.group_k % bk == 0):
            bk //= 2
        return (bk, False) if bk >= 128 else (max(wanted, 128), True)
    return max(wanted, 32), False  # NVFP4: per-element scales; two dots of BLOCK_K / 2


@triton.jit
def _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, offs_m, m_ok, offs_n, n_ok, M, N, stride_om, tile, split,
            splits, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr):
    """Add the bias and store, or (split K) store this part and let the last part to arrive
    sum all of them in part order."""
    out_mask = m_ok[:, None] & n_ok[None, :]
    dest = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if not SPLIT_K:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(dest, round_to(acc, out_ptr.dtype.element_ty, ROUND), mask=out_mask)
    else:
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + split * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partials are stored before the counter moves
        counter = count_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(splits):  # part order: the same sum every time
                total += tl.load(parts + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(dest, round_to(total, out_ptr.dtype.element_ty, ROUND), mask=out_mask)
            tl.store(counter, 0)


# The scale groups are compile-time constants (a few per format): a step's group index is
# then a shift, where a run-time divisor cost an integer division each K step (24 of the
# 449 instructions of the int4 one-row loop, sm_90 code from Triton 3.6).
@triton.jit(do_not_specialize=["M"])
def _quant_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, alpha_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, splits, group_n: tl.constexpr, group_k: tl.constexpr,
    stride_xm, stride_xk, stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, stride_om,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr,
    OFFSET: tl.constexpr, SCALE_PER_ELEMENT: tl.constexpr, GEMV: tl.constexpr, UPCAST: tl.constexpr,
    ROUND: tl.constexpr, QROUND: tl.constexpr, USE_PDL: tl.constexpr, SWAP: tl.constexpr, HALF: tl.constexpr,
    PACKED: tl.constexpr = False, X_BF16: tl.constexpr = True, EVEN_K: tl.constexpr = False,
    FP8_SCALE: tl.constexpr = 0, PAIRS: tl.constexpr = False,
    EMULATE: tl.constexpr = False, AHEAD: tl.constexpr = False, UNROLL: tl.constexpr = 1,
    VEC: tl.constexpr = 4, STAGED: tl.constexpr = 0,
):
    pid_m, pid_n = _block_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if USE_PDL:  # x comes from the kernel before
        pdl.wait()
    if PACKED and FORMAT == 0:  # FP8, one row a program: whole words (.fp8_gemv)
        acc = fp8_gemv_row(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, s_ptr, offs_n, n_ok, k_begin, k_end,
                           stride_wn, stride_sn, stride_sk, group_n, group_k, BLOCK_N, BLOCK_K, FP8_SCALE,
                           X_BF16, EVEN_K, EMULATE, AHEAD, UNROLL, VEC, STAGED)
    elif PACKED:  # int4, one row a program: packed fp16 pairs (.int4_fp16)
        acc = int4_gemv_row(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, s_ptr, z_ptr, offs_n, n_ok, k_begin, k_end,
                            stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_k,
                            BLOCK_N, BLOCK_K, X_BF16, EVEN_K, EMULATE, AHEAD, UNROLL, VEC, STAGED)
    elif GEMV:
        acc = quant_gemv_tile(x_ptr + offs_m * stride_xm, m_ok, stride_xk, w_ptr, s_ptr, z_ptr, offs_n, n_ok,
                              k_begin, k_end, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk,
                              group_n, group_k, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = quant_tile(x_ptr + offs_m * stride_xm, xs_ptr + offs_m * stride_xsm, m_ok, stride_xk,
                         w_ptr, s_ptr, z_ptr, offs_n, n_ok, k_begin, k_end,
                         stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk, group_n, group_k,
                         FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, OFFSET, SCALE_PER_ELEMENT, UPCAST, QROUND, SWAP,
                         HALF, PAIRS)
    if FORMAT == 3:  # NVFP4's one factor
        acc *= tl.load(alpha_ptr)
    _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, offs_m, m_ok, offs_n, n_ok, M, N, stride_om,
            pid_m * tl.cdiv(N, BLOCK_N) + pid_n, split, splits, SPLIT_K, HAS_BIAS, ROUND)


def kernel_options(x: torch.Tensor, op: Operands, config: QuantGemmConfig) -> dict | None:
    """Format-dependent constexprs for x's dtype, or None when no kernel fits. FP8 on the
    tensor cores quantizes decode rows inside the GEMM when its K step is one activation
    group, and larger batches in a kernel before (there every column tile would repeat it)."""
    fmt = FP8_ACT if op.fmt == FP8 and config.act_quant else op.fmt
    fit = block_k_for(op, fmt, config.BLOCK_K)
    if fit is None or x.dtype not in INT4_MAGIC:
        return None
    if fmt == FP8_ACT and fit[0] == ACT_GROUP and x.shape[0] <= DECODE_ROWS:
        fmt = FP8_ACT_INLINE
    magic, offset = INT4_MAGIC[x.dtype]
    gemv = config.gemv and fmt in (FP8, INT4) and not fit[1]
    swap = config.swap and fmt in (FP8, FP8_ACT, FP8_ACT_INLINE) and not gemv
    return {"FORMAT": fmt, "BLOCK_K": fit[0], "SCALE_PER_ELEMENT": fit[1], "GEMV": gemv, "SWAP": swap,
            "MAGIC": magic, "OFFSET": offset, "HALF": fmt in (FP8, NVFP4) and half_products(x),
            "UPCAST": x.device.type != "cuda", "ROUND": x.device.type != "cuda" and x.dtype == torch.bfloat16,
            "QROUND": x.device.type != "cuda"}


def packed_steps() -> bool:
    """``NINFER_PACKED_STEPS=0`` keeps FP8 and int4 on the value-by-value steps: one row on
    the gemv tile, int4 tiles without fp16 pairs (read per call, for comparisons)."""
    return os.environ.get("NINFER_PACKED_STEPS", "1") != "0"


def packed_flags(x: torch.Tensor, weights: list[Operands], fmt: int, one_row: bool, scale_per_element: bool,
                 fp8_scale: int, block_k: int) -> dict:
    """The packed steps' constexprs, shared by this GEMM and :mod:`.quant_moe`. A one-row
    program (``one_row``) takes :mod:`.int4_fp16` or :mod:`.fp8_gemv` when x's rows are
    contiguous and 4-byte aligned (x is read two columns a word), an FP8 weight's rows are
    whole words and its scale is uniform where the step applies it (``fp8_scale``, from
    :func:`.fp8_gemv.uniform_scale`); int4 ``tl.dot`` tiles make their weights in fp16
    pairs. Both need every K step inside one scale group (not ``scale_per_element``)."""
    steps = packed_steps() and not scale_per_element
    k = weights[0].k
    row = (one_row and steps and (fmt == INT4 or fp8_scale > 0)
           and x.stride(1) == 1 and x.data_ptr() % 4 == 0 and (x.shape[0] == 1 or x.stride(0) % 2 == 0)
           and (fmt == INT4 or k % 4 == 0 and all(  # whole words: every row starts on one, K fills its last
               w.data.stride(-1) == 1 and w.data.stride(-2) % 4 == 0 and w.data.data_ptr() % 16 == 0
               for w in weights)))
    return {"PACKED": row, "X_BF16": x.dtype == torch.bfloat16, "EVEN_K": k % block_k == 0,
            "FP8_SCALE": fp8_scale, "EMULATE": x.device.type != "cuda", "PAIRS": fmt == INT4 and steps and not row}


def packed_options(x: torch.Tensor, op: Operands, options: dict, block_m: int, block_n: int, block_k: int) -> dict:
    """:func:`packed_flags` for this GEMM: one-row gemv programs take the packed steps."""
    fmt = options["FORMAT"]
    fp8_scale = uniform_scale((op.group_n, op.group_k), block_n, op.k) if fmt == FP8 else 0
    flags = packed_flags(x, [op], fmt, options["GEMV"] and block_m == 1, options["SCALE_PER_ELEMENT"], fp8_scale,
                         block_k)
    flags["PAIRS"] = flags["PAIRS"] and not options["GEMV"]  # the gemv tile has no tl.dot to feed
    return flags


def cublas_route(x: torch.Tensor, weight: qf.QuantWeight, bias: torch.Tensor | None,
                 route: str) -> torch.Tensor | None:
    """The product by one of :mod:`.cublas_prefill`'s routes, or None where that route does
    not serve x and this weight (the Triton kernel runs instead)."""
    if route == "dense":
        return cublas_prefill.dense_matmul(x, weight, bias)
    if route == "block_scaled":
        ok = cublas_prefill.block_scaled_available(x, weight)
        return cublas_prefill.block_scaled_matmul(x, weight, bias) if ok else None
    raise ValueError(f"unknown quantized GEMM route {route!r} (triton, dense or block_scaled)")


def quant_matmul(x: torch.Tensor, weight: qf.QuantWeight, bias: torch.Tensor | None = None,
                 config: QuantGemmConfig | None = None) -> torch.Tensor:
    """``x`` [M, K] (bf16/fp16) times a 2-D quantized weight: [M, N] in x's dtype, float32
    accumulation rounded once. ``config`` overrides the table (tests, the sweep). Unless a
    config is given, int4 at one to eight rows runs on the tensor cores from registers
    (:mod:`.int4_mma`; ``NINFER_INT4_MMA=0``: not), and FP8 does with ``NINFER_FP8_MMA=1``
    (:mod:`.fp8_mma`); a config routed ``mma`` sends FP8 there too."""
    if config is None and isinstance(weight, qf.Int4Group) and int4_mma.enabled() and int4_mma.takes(x, weight):
        return int4_mma.int4_mma_matmul(x, weight, bias)
    if config is None and isinstance(weight, qf.Fp8Block) and fp8_mma.enabled() and fp8_mma.takes(x, weight):
        return fp8_mma.fp8_mma_matmul(x, weight, bias)
    op = operands(weight)
    if weight.shape[:-2]:
        raise ValueError(f"quant_linear takes a 2-D weight, got {tuple(weight.shape)}")
    rows = x.shape[0]
    if rows == 0:
        return torch.empty(0, op.n, dtype=x.dtype, device=x.device)
    config = config or choose_config(x, op)
    if config.route == "mma":
        if isinstance(weight, qf.Fp8Block) and fp8_mma.takes(x, weight):
            tiles = max(1, min(2, config.BLOCK_N // (16 * config.num_warps)))
            return fp8_mma.fp8_mma_matmul(x, weight, bias, num_warps=config.num_warps, splits=config.SPLITS,
                                          tiles=tiles)
        config = heuristic_config(op.fmt, rows, op.n, op.k, sm_count(x.device))  # a shape it does not take
    if config.route != "triton":
        routed = cublas_route(x, weight, bias, config.route)
        if routed is not None:
            return routed
        config = heuristic_config(op.fmt, rows, op.n, op.k, sm_count(x.device))  # FP8's tiles
    out = torch.empty(rows, op.n, dtype=x.dtype, device=x.device)
    options = kernel_options(x, op, config)
    if options is None:
        return qf.quant_linear(x, weight, bias)
    # tl.dot wants 16 rows and columns at least; the gemv tiles take exactly what they cover
    floor = 1 if options["GEMV"] else 16
    block_m = min(config.BLOCK_M, max(floor, triton.next_power_of_2(rows)))
    block_n = min(config.BLOCK_N, max(floor, triton.next_power_of_2(op.n)))
    block_k = options.pop("BLOCK_K")
    options.update(packed_options(x, op, options, block_m, block_n, block_k))
    # the staged loop stands alone: ahead and unroll are for the register-prefetch loop
    options["STAGED"] = config.staged if options["PACKED"] else 0
    options["AHEAD"] = config.ahead and options["PACKED"] and not options["STAGED"]  # the same sums either way
    options["UNROLL"] = config.unroll if options["PACKED"] and not options["STAGED"] else 1
    options["VEC"] = config.vec if options["PACKED"] else 4
    x_in, x_scales = (quantize_activations(x.contiguous()) if options["FORMAT"] == FP8_ACT else (x, x))
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(op.n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(op.k, config.SPLITS), block_k) * block_k  # whole K steps
    splits = triton.cdiv(op.k, k_per_split)
    if splits > 1:
        parts = torch.empty(splits, rows, op.n, dtype=torch.float32, device=x.device)
        counters = counter_buffer("quant_gemm", x.device, tiles, 4096)
    else:
        parts = counters = out  # unused
    use_pdl = pdl.enabled(x.device)
    _quant_gemm_kernel[(tiles, splits)](
        x_in, x_scales, op.data, op.scale, *zero_args(op), op.alpha, bias if bias is not None else out, out, parts,
        counters,
        rows, op.n, op.k, k_per_split, splits, op.group_n, op.group_k,
        x_in.stride(0), x_in.stride(1), x_scales.stride(0), *op.strides(), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits > 1, GROUP_M=config.GROUP_M,
        HAS_BIAS=bias is not None, USE_PDL=use_pdl, **options,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(use_pdl),
    )
    return out


def quant_linear(x: torch.Tensor, weight: qf.QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA ``quant_linear`` op: any leading dims on x; the reference for what no
    kernel covers (float32 x, stacked weights, odd groupings)."""
    if weight.shape[:-2] or x.dtype not in INT4_MAGIC:
        return qf.quant_linear(x, weight, bias)
    lead = x.shape[:-1]
    out = quant_matmul(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*lead, out.shape[-1])
