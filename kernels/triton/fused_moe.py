"""Fused mixture-of-experts on CUDA: two grouped GEMMs over the expert-sorted layout.

:func:`ninfer_kernels.triton.moe_route.moe_align` sorts the (token, choice) pairs into
per-expert runs padded to ``block_m`` rows, so every ``block_m``-row block belongs to
one expert. Then (the design of vLLM's fused_moe, in our own code):

1. the gate_up kernel: each program takes one block of rows and ``BLOCK_N`` columns of
   the intermediate, accumulates the gate rows and the up rows of that expert's ``w13``
   over the hidden size, and stores ``silu(gate) * up``: the [P, 2I] product never
   reaches memory;
2. the down kernel: the same blocks times ``w2[e]``, scaled by the pair's weight in the
   epilogue, one row per pair;
3. a small kernel sums each token's k' rows in float32 (no atomics: deterministic).

Grids are sized from the pair count (the most blocks the layout can have); programs
whose block lies past the runs (read on the device) return at once, so nothing syncs
and the whole op can be captured in a CUDA graph. A single token skips the sorting: its
pairs name distinct experts, so each pair is a block of its own (``PER_PAIR``); by
default one token takes the matrix-vector kernels of :mod:`.moe_single_token` instead. Expert
id ``E`` is the shared expert: the same tile loop reads its own tensor, laid out like one
routed expert (the model keeps it so; any other layout is copied first), so the loads
stay vectorised and the pipeline's shared memory is allocated once.

Under PDL (:mod:`.pdl`) each kernel is launched while the one before it finishes and
waits for it before reading anything, which hides its launch latency.

Block shapes are chosen on the host from the token count alone (:mod:`.moe_shapes`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.moe_route import moe_align
from ninfer_kernels.triton.moe_shapes import (  # noqa: F401  (re-exported: the tuning scripts use them)
    CONFIG_DIR, GemmConfig, MoeConfig, device_name, heuristic_config, load_table, select_config, shape_key,
)
from ninfer_kernels.triton.moe_single_token import DEFAULT_CONFIG, expert_rows_one_token
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: columns per program of the final per-token sum
SUM_BLOCK = 1024


# -- kernels --------------------------------------------------------------------------


@triton.jit
def _block_of(pid, max_rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: GROUP_M row blocks share each column
    block in turn, so neighbouring programs reuse the same weight tile from L2."""
    num_pid_m = tl.cdiv(max_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 operands: full precision, not TF32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gate_up_tile(a_ptrs, stride_ak, row_ok, w_ptr, stride_wn, stride_wk, offs_n, n_ok, half, K,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Gate and up accumulators [BLOCK_M, BLOCK_N]: rows ``offs_n`` and ``half + offs_n``
    of one expert's [2I, K] weight against the gathered activation rows."""
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + half * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 dot operands as raw bits
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = acc_g + _mma(a, bg, IEEE)
        acc_u = acc_u + _mma(a, bu, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    return acc_g, acc_u


@triton.jit
def _down_tile(a_ptrs, stride_ak, row_ok, w_ptr, stride_wn, stride_wk, offs_n, n_ok, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Accumulator [BLOCK_M, BLOCK_N]: the gathered intermediate rows times rows ``offs_n``
    of one expert's [N, K] down weight."""
    offs_k = tl.arange(0, BLOCK_K)
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = acc + _mma(a, b, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _rows_of(pid, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr, max_rows, N,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PER_PAIR: tl.constexpr):
    """This program's (expert, pair of each row, column block); expert -1: nothing to do.

    Sorted layout: a block of the expert-sorted runs. PER_PAIR (one token: its pairs all
    name different experts, so nothing is gained by sorting): block ``b`` is pair ``b``
    alone, in row 0."""
    if PER_PAIR:
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = pid // num_pid_n, pid % num_pid_n
        expert = tl.load(ids_ptr + pid_m)
        rows = tl.arange(0, BLOCK_M)
        pair = tl.where(rows == 0, pid_m, max_rows).to(tl.int64)  # max_rows: the pair count here
    else:
        pid_m, pid_n = _block_of(pid, max_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
        expert = tl.load(block_experts_ptr + pid_m)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            expert = -1  # past the last run
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pair, pid_n


@triton.jit(do_not_specialize=["pairs", "max_rows"])
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
    pairs, max_rows, top_k, shared_id, N, K,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_SHARED: tl.constexpr, PER_PAIR: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the routing (or the layout) comes from the kernel just before
        pdl.wait()
    expert, pair, pid_n = _rows_of(tl.program_id(0), sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
                                   max_rows, N, BLOCK_M, BLOCK_N, GROUP_M, PER_PAIR)
    if expert == -1:
        return
    row_ok = pair < pairs  # the sentinel P pads each run
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pair // top_k)[:, None] * stride_xt + offs_k[None, :] * stride_xk
    w = w_ptr + expert.to(tl.int64) * stride_we
    if HAS_SHARED:  # the shared expert: same layout, its own tensor
        if expert == shared_id:
            w = s_ptr
    acc_g, acc_u = _gate_up_tile(a_ptrs, stride_xk, row_ok, w, stride_wn, stride_wk, offs_n, n_ok, N, K,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, UPCAST)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    dest = out_ptr + pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(dest, round_to(h, out_ptr.dtype.element_ty, UPCAST), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["pairs", "max_rows"])
def _down_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
    pairs, max_rows, shared_id, N, K,
    stride_at, stride_we, stride_wn, stride_wk, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_SHARED: tl.constexpr, PER_PAIR: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl.wait()
    expert, pair, pid_n = _rows_of(tl.program_id(0), sorted_ptr, block_experts_ptr, num_padded_ptr, ids_ptr,
                                   max_rows, N, BLOCK_M, BLOCK_N, GROUP_M, PER_PAIR)
    if expert == -1:
        return
    row_ok = pair < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair[:, None] * stride_at + offs_k[None, :]
    w = w_ptr + expert.to(tl.int64) * stride_we
    if HAS_SHARED:
        if expert == shared_id:
            w = s_ptr
    acc = _down_tile(a_ptrs, 1, row_ok, w, stride_wn, stride_wk, offs_n, n_ok, K,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE, UPCAST)
    wt = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    dest = out_ptr + pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(dest, round_to(acc * wt[:, None], out_ptr.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs_kernel(rows_ptr, out_ptr, width, TOP_K: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                      USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * width + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * width + cols, round_to(acc, out_ptr.dtype.element_ty, ROUND), mask=ok)


def single_token_kernels() -> bool:
    """Whether one token takes :mod:`.moe_single_token`'s kernels (``NINFER_MOE_ONE_TOKEN=0``
    keeps it on the grouped GEMMs; read per call, so a benchmark can compare the two)."""
    return os.environ.get("NINFER_MOE_ONE_TOKEN", "1") != "0"


def _launch_options(x: torch.Tensor) -> dict:
    # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as raw bits, and
    # truncates where it should round: UPCAST works around both.
    use_pdl = pdl.enabled(x.device)
    return {"IEEE": x.dtype == torch.float32, "UPCAST": interpreted_bf16(x), "USE_PDL": use_pdl,
            **pdl.launch_options(use_pdl)}


def _fit(cfg: GemmConfig, n: int, k: int) -> GemmConfig:
    """No tile wider than the (power-of-two rounded) matrix, nor under tl.dot's 16."""
    return cfg.clipped(max(16, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(k)))


def _layout_args(align, pair_ids: torch.Tensor | None, pairs: int, block_m: int, n: int, block_n: int):
    """Grid and layout arguments: the sorted layout ``align``, or (``align`` None) one
    block per pair with each pair's expert in ``pair_ids``."""
    if align is None:
        assert pair_ids is not None
        dummy = pair_ids
        return (pairs * triton.cdiv(n, block_n),), (dummy, dummy, dummy, pair_ids), pairs
    sorted_pairs, block_experts, num_padded = align
    grid = (triton.cdiv(sorted_pairs.numel(), block_m) * triton.cdiv(n, block_n),)
    return grid, (sorted_pairs, block_experts, num_padded, sorted_pairs), sorted_pairs.numel()


def _row_major(w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The shared expert's weight with its routed siblings' strides (one tile loop serves
    both); a differently laid-out weight is copied."""
    return w if w.stride() == like.stride() else w.contiguous()


def _one_token_shared(shared13, shared2, w13, w2) -> tuple:
    """The shared expert's weights as the single-token kernels read them (:func:`_row_major`),
    or (None, None)."""
    if shared13 is None:
        return None, None
    return _row_major(shared13, w13[0]), _row_major(shared2, w2[0])


def gate_up(x, w13, shared13, align, top_k: int, block_m: int, cfg: GemmConfig,
            pair_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for every pair: [P, I] in ``x``'s dtype (P = T * top_k)."""
    pairs, hidden = x.shape[0] * top_k, x.shape[1]
    inter = w13.shape[1] // 2
    out = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    cfg = _fit(cfg, inter, hidden)
    s = _row_major(shared13, w13[0]) if shared13 is not None else w13[0]
    grid, layout, max_rows = _layout_args(align, pair_ids, pairs, block_m, inter, cfg.BLOCK_N)
    _gate_up_kernel[grid](
        x, w13, s, out, *layout,
        pairs, max_rows, top_k, w13.shape[0], inter, hidden,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        HAS_SHARED=shared13 is not None, PER_PAIR=align is None, EVEN_K=hidden % cfg.BLOCK_K == 0,
        **_launch_options(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def down(inter, w2, shared2, weights, align, block_m: int, cfg: GemmConfig,
         pair_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's down projection times its weight: [P, H] in ``inter``'s dtype."""
    pairs, width = inter.shape
    hidden = w2.shape[1]
    out = torch.empty(pairs, hidden, dtype=inter.dtype, device=inter.device)
    cfg = _fit(cfg, hidden, width)
    s = _row_major(shared2, w2[0]) if shared2 is not None else w2[0]
    grid, layout, max_rows = _layout_args(align, pair_ids, pairs, block_m, hidden, cfg.BLOCK_N)
    _down_kernel[grid](
        inter, w2, s, out, weights, *layout,
        pairs, max_rows, w2.shape[0], hidden, width,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        HAS_SHARED=shared2 is not None, PER_PAIR=align is None, EVEN_K=width % cfg.BLOCK_K == 0,
        **_launch_options(inter), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def finish_pairs(rows: torch.Tensor, num_tokens: int, top_k: int, summed: bool) -> torch.Tensor:
    """[T * top_k, H] pair rows: summed per token (:func:`sum_pairs`), or as [T, top_k, H]
    for the norm after the layer to sum (``summed`` false)."""
    return sum_pairs(rows, num_tokens, top_k) if summed else rows.view(num_tokens, top_k, rows.shape[1])


def sum_pairs(rows: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T * top_k, H] -> [T, H]: each token's rows summed in float32, rounded once."""
    width = rows.shape[1]
    out = torch.empty(num_tokens, width, dtype=rows.dtype, device=rows.device)
    use_pdl = pdl.enabled(rows.device)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(width, SUM_BLOCK))](
        rows, out, width, TOP_K=top_k, BLOCK=SUM_BLOCK, ROUND=interpreted_bf16(rows), USE_PDL=use_pdl,
        **pdl.launch_options(use_pdl))
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared13: torch.Tensor | None = None,
    shared2: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    summed: bool = True,
) -> torch.Tensor:
    """Same contract as :func:`ninfer_kernels.moe.fused_moe`; ``config`` overrides the
    tuned/heuristic block shapes (tests and the tuning script force small ones).
    Quantized expert weights (:mod:`ninfer_kernels.quant_formats`) go to :mod:`.quant_moe`."""
    if not isinstance(w13, torch.Tensor):
        from ninfer_kernels.triton.quant_moe import quant_fused_moe  # imports this module
        return quant_fused_moe(x, w13, w2, weights, ids, shared13, shared2, summed=summed)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = ids.shape[1]
    has_shared = shared13 is not None
    if (shared2 is not None) != has_shared:
        raise ValueError("give both shared13 and shared2, or neither")
    if has_shared and (tuple(shared13.shape) != (two_i, hidden) or tuple(shared2.shape) != tuple(w2.shape[1:])):
        raise ValueError(f"shared expert weights {tuple(shared13.shape)}, {tuple(shared2.shape)} do not match "
                         f"the experts' {tuple(w13.shape[1:])}, {tuple(w2.shape[1:])}")
    if num_tokens == 0:
        return torch.empty_like(x) if summed else x.new_empty(0, top_k, hidden)
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    weights = weights.float().contiguous()
    chosen = config is None
    if chosen:
        config = select_config(x.device, num_experts + has_shared, hidden, two_i // 2, top_k, x.dtype, num_tokens)
    # one token: the matrix-vector kernels, unless a caller forces grouped-GEMM shapes
    if num_tokens == 1 and single_token_kernels() and (chosen or config.one_token is not None):
        s13, s2 = _one_token_shared(shared13, shared2, w13, w2)
        rows = expert_rows_one_token(x, w13, w2, weights, ids, s13, s2, config.one_token or DEFAULT_CONFIG)
        return finish_pairs(rows, 1, top_k, summed)
    # one token's pairs name distinct experts: each pair is its own block, no sorting
    align = moe_align(ids, num_experts + has_shared, config.block_m) if num_tokens > 1 else None
    inter = gate_up(x, w13, shared13, align, top_k, config.block_m, config.gate_up, pair_ids=ids)
    rows = down(inter, w2, shared2, weights, align, config.block_m, config.down, pair_ids=ids)
    return finish_pairs(rows, num_tokens, top_k, summed)
