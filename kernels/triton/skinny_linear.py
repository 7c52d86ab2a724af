"""``y = x W^T (+ b)`` for a few rows of ``x`` (decode batches), where cuBLAS is slow.

At batch 1-8 a projection only streams its weight, and cuBLAS does that well for most
shapes. Not for the narrowest: a MoE router (Qwen3.6-35B-A3B's 2048 -> 256, 1 MB) took
5.7 us, a launch's worth of latency for a few hundred KB. This kernel spreads any such
read evenly: a program takes ``BLOCK_N`` output columns and one of ``SPLITS`` equal
parts of the inner dimension, all of ``x``'s rows at once (a 16-row ``tl.dot`` tile,
rows past M masked, so the weight is read once whatever M is). With several parts,
each program stores its float32 partial sums and the part that finishes last for a
column block (an arrival counter, reset after) adds them in part order, so results do
not depend on timing. It launches with PDL and fetches its first weight tile before
waiting for the kernel that wrote ``x``. With ``swap`` a program computes ``W x^T``
instead, the weight tile as the first operand: compiled for sm_90 that runs Hopper's
warpgroup MMA on the weight tile as the pipeline put it in shared memory, where ``x W^T``
runs the 16-row MMA on tiles loaded into registers first (a sweep candidate, untimed).

:func:`choose` decides per call from the shapes alone (so a CUDA graph replays the same
choice): an entry of the tuned table ``linear_configs/<device>.json`` (written by
scripts/gpu_skinny_sweep.py, one per (N, K, dtype) and row count that measured faster
than cuBLAS; today the routers: 4.2 us) or None, meaning cuBLAS.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to
from ninfer_kernels.triton.tuned_tables import device_name, read_table

CONFIG_DIR = Path(__file__).parent / "linear_configs"
#: most rows of x this kernel takes (one tl.dot tile)
MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLITS: int = 1
    num_warps: int = 4
    num_stages: int = 3
    #: the weight tile as the MMA's first operand (``W x^T``): Hopper's warpgroup MMA
    #: over 64 weight rows instead of the 16-row MMA with x's rows padded to 16
    swap: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def table_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"N={n},K={k},{str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, SkinnyConfig]]:
    """``linear_configs/<name>.json`` as {key: {rows: config}} (keys starting "_" are comments)."""
    return {key: {int(m): SkinnyConfig(**c) for m, c in per_m.items()}
            for key, per_m in read_table(CONFIG_DIR, name).items()}


def choose(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
    """This call's tuned config, or None for cuBLAS: the entry for the nearest row count at
    or above x's, when the table has this shape. Host-side, from shapes only."""
    if x.device.type != "cuda" or x.dim() != 2 or x.shape[0] > MAX_ROWS or not enabled():
        return None
    rows = x.shape[0]
    per_rows = load_table(device_name(x.device)).get(table_key(weight.shape[0], weight.shape[1], x.dtype))
    if not per_rows:
        return None
    at_or_above = [m for m in per_rows if m >= rows]
    return per_rows[min(at_or_above)] if at_or_above else None


def enabled() -> bool:
    """``NINFER_SKINNY_LINEAR=0`` keeps every matmul on cuBLAS (read per call, for benchmarks)."""
    return os.environ.get("NINFER_SKINNY_LINEAR", "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA ``linear`` op: this kernel where the table says it is faster, else cuBLAS."""
    config = choose(x, weight)
    if config is None:
        return torch.nn.functional.linear(x, weight, bias)
    return skinny_linear(x, weight, bias, config)


@triton.jit
def _mma(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """float32 ``a @ b``; ``UPCAST``: in float32 (the interpreter multiplies bf16 dot
    operands as raw bits), ``IEEE``: float32 operands without TF32."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _partial(x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, k_begin, k_end, stride_xm, stride_xk, stride_wn, stride_wk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
             UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: x's rows times the weight's rows ``offs_n`` over columns
    ``k_begin`` to ``k_end``."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + offs_k)[None, :] * stride_xk
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_begin + offs_k)[:, None].to(tl.int64) * stride_wk
    # The weight is never what the kernel before wrote: its first tile is fetched before
    # waiting on that kernel (PDL), so the stream starts while the previous one finishes.
    b = tl.load(b_ptrs, mask=(offs_k < k_end - k_begin)[:, None] & n_ok[None, :], other=0.0)
    if USE_PDL:
        pdl.wait()  # x comes from the kernel before
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k < k_end - k0)[None, :], other=0.0)
        acc += _mma(a, b, IEEE, UPCAST)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
        b = tl.load(b_ptrs, mask=(offs_k < k_end - k0 - BLOCK_K)[:, None] & n_ok[None, :], other=0.0)
    return acc


@triton.jit
def _partial_swapped(x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, k_begin, k_end, stride_xm, stride_xk, stride_wn,
                     stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """:func:`_partial` as ``W x^T`` (the weight tile first), transposed once at the end."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_begin + offs_k)[:, None] * stride_xk  # x^T [BLOCK_K, BLOCK_M]
    b_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_begin + offs_k)[None, :].to(tl.int64) * stride_wk
    b = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_k < k_end - k_begin)[None, :], other=0.0)
    if USE_PDL:
        pdl.wait()  # x comes from the kernel before
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_k < k_end - k0)[:, None] & m_ok[None, :], other=0.0)
        acc_t += _mma(b, a, IEEE, UPCAST)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
        b = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_k < k_end - k0 - BLOCK_K)[None, :], other=0.0)
    return tl.trans(acc_t)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if SWAP:
        acc = _partial_swapped(x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, k_begin, k_end, stride_xm, stride_xk,
                               stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST, USE_PDL)
    else:
        acc = _partial(x_ptr, w_ptr, offs_m, m_ok, offs_n, n_ok, k_begin, k_end, stride_xm, stride_xk,
                       stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, UPCAST, USE_PDL)
    out_mask = m_ok[:, None] & n_ok[None, :]
    dest = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(dest, round_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=out_mask)
    else:
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + split * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partials are stored before the counter moves
        counter = count_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # part order: the same sum every time
                total += tl.load(parts + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(dest, round_to(total, out_ptr.dtype.element_ty, UPCAST), mask=out_mask)
            tl.store(counter, 0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [M <= 16, K] and ``weight`` [N, K] of any
    strides; the product accumulates in float32 and is rounded once to x's dtype."""
    rows, inner = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n = min(config.BLOCK_N, max(16, triton.next_power_of_2(n)))
    block_k = min(config.BLOCK_K, max(16, triton.next_power_of_2(inner)))
    col_blocks = triton.cdiv(n, block_n)
    # each part a whole number of K tiles, and no empty part
    k_per_split = triton.cdiv(triton.cdiv(inner, config.SPLITS), block_k) * block_k
    splits = triton.cdiv(inner, k_per_split)
    if splits > 1:
        parts = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
        counters = counter_buffer("skinny_linear", x.device, col_blocks, 4096)
    else:
        parts = counters = out  # unused
    use_pdl = pdl.enabled(x.device)
    _skinny_kernel[(col_blocks, splits)](
        x, weight, bias if bias is not None else out, out, parts, counters, rows, n, inner, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, UPCAST=interpreted_bf16(x), USE_PDL=use_pdl, SWAP=config.swap,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(use_pdl),
    )
    return out
