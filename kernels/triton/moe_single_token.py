"""Mixture-of-experts for one token (batch-1 decode): two matrix-vector kernels.

With one token the expert GEMMs are matrix-vector products: the work is reading the k'
chosen experts' weights once, at the copy bandwidth if the reads are spread evenly over
the SMs. The grouped GEMM of :mod:`.fused_moe` pads the token to a 16-row ``tl.dot`` tile
with at least 16 columns a program, so 9 experts x 512 columns made 144 programs for
132 SMs: a dozen SMs ran two while the rest idled, and the kernel read at about 60% of
the bandwidth. Here the products are sums of elementwise products in float32 (no
``tl.dot``, so a program may own as few as two weight rows), which lets the grid hold
many more, smaller programs:

1. gate_up: program ``(pair j, column block)`` reads its ``BLOCK_N`` gate rows and up
   rows of expert ``ids[j]`` and stores ``silu(gate) * up`` for them;
2. down: program ``(pair j, column block)`` of the hidden size reads its expert's
   ``BLOCK_N`` down rows and stores their products with the intermediate, scaled by the
   pair's weight; the grouped path's sum kernel then adds the k' rows. (One program
   looping over all k' pairs of a column block, which saves that kernel, measured
   slower: its nine dependent weight reads ran one after another.) The rounding points
   are the reference's.

Both launch with PDL where available (the ids come from the routing kernel before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to


@dataclass(frozen=True)
class SingleTokenConfig:
    """Launch shapes of the two kernels (rows of weight per program, K tile, warps, and the
    stages of the K loop: above 1, Triton stages the weight tiles through shared memory by
    asynchronous copies, ``stages - 1`` K tiles ahead, as the quantized one-row steps'
    ``staged`` does (docs/weight-formats.md); 1 loads each tile where it is used)."""

    gate_up_n: int = 2
    gate_up_k: int = 1024
    gate_up_warps: int = 4
    down_n: int = 4
    down_k: int = 256
    down_warps: int = 4
    gate_up_stages: int = 1
    down_stages: int = 1


#: for shapes without a table entry: the Qwen3.6-35B-A3B shape's best on the H200
#: (scripts/gpu_skinny_sweep.py writes each shape's into the MoE table as ``one_token``)
DEFAULT_CONFIG = SingleTokenConfig()


@triton.jit
def _row_dots(w_ptrs, x_ptr, stride_wk, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr):
    """float32 [BLOCK_N]: rows of a weight (``w_ptrs`` at column 0) dotted with ``x``."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < K - k0
        xv = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptrs + (k0 + offs_k)[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gate_up_dots(w_ptrs, x_ptr, up_offset, stride_wk, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    """float32 [BLOCK_N] twice: :func:`_row_dots` of the gate rows at ``w_ptrs`` and of the
    up rows ``up_offset`` elements further, in one loop. Both tiles of a step are loaded
    before either is used, so a program has twice the bytes in flight; one loop after the
    other, the up rows' loads waited for the gate's sum (its barrier)."""
    offs_k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < K - k0
        w_ok = n_ok[:, None] & k_ok[None, :]
        cols = (k0 + offs_k)[None, :] * stride_wk
        gw = tl.load(w_ptrs + cols, mask=w_ok, other=0.0)
        uw = tl.load(w_ptrs + up_offset + cols, mask=w_ok, other=0.0)
        xv = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        gate += gw.to(tl.float32) * xv[None, :]
        up += uw.to(tl.float32) * xv[None, :]
    return tl.sum(gate, 1), tl.sum(up, 1)


@triton.jit
def _expert_rows(w_ptr, s_ptr, expert, offs_n, shared_id, stride_we, stride_wn, HAS_SHARED: tl.constexpr):
    """Pointers to rows ``offs_n`` (column 0) of ``expert``'s weight."""
    w = w_ptr + expert.to(tl.int64) * stride_we
    if HAS_SHARED:  # the shared expert: same layout, its own tensor
        if expert == shared_id:
            w = s_ptr
    return w + offs_n[:, None].to(tl.int64) * stride_wn


@triton.jit
def _gate_up_pair(x_ptr, w_ptr, s_ptr, out_ptr, expert, pair, offs_n, n_ok, shared_id, N, K, stride_we, stride_wn,
                  stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                  ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Store ``silu(gate) * up`` of pair ``pair`` (expert ``expert``) for columns ``offs_n``."""
    rows = _expert_rows(w_ptr, s_ptr, expert, offs_n, shared_id, stride_we, stride_wn, HAS_SHARED)
    gate, up = _gate_up_dots(rows, x_ptr, N * stride_wn, stride_wk, n_ok, K, BLOCK_N, BLOCK_K, STAGES)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pair * N + offs_n, round_to(h, out_ptr.dtype.element_ty, ROUND), mask=n_ok)


@triton.jit
def _gate_up_one_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, shared_id, N, K,
    stride_we, stride_wn, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr, STAGES: tl.constexpr = 1,
):
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_PDL:  # the ids come from the routing kernel just before
        pdl.wait()
    _gate_up_pair(x_ptr, w_ptr, s_ptr, out_ptr, tl.load(ids_ptr + pair), pair, offs_n, offs_n < N, shared_id, N, K,
                  stride_we, stride_wn, stride_wk, BLOCK_N, BLOCK_K, HAS_SHARED, ROUND, STAGES)


@triton.jit
def _down_one_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, ids_ptr, shared_id, N, K,
    stride_we, stride_wn, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr, ROUND: tl.constexpr,
    USE_PDL: tl.constexpr, STAGES: tl.constexpr = 1,
):
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if USE_PDL:  # the intermediate comes from the gate_up kernel just before
        pdl.wait()
    rows = _expert_rows(w_ptr, s_ptr, tl.load(ids_ptr + pair), offs_n, shared_id, stride_we, stride_wn, HAS_SHARED)
    acc = _row_dots(rows, h_ptr + pair * K, stride_wk, n_ok, K, BLOCK_N, BLOCK_K, STAGES)
    scaled = acc * tl.load(weights_ptr + pair)
    tl.store(out_ptr + pair * N + offs_n, round_to(scaled, out_ptr.dtype.element_ty, ROUND), mask=n_ok)


def _tile(wanted: int, width: int) -> int:
    """The configured tile, shrunk to the (power-of-two rounded) width it covers."""
    return min(wanted, triton.next_power_of_2(max(width, 1)))


def expert_rows_one_token(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared13: torch.Tensor | None,
    shared2: torch.Tensor | None,
    config: SingleTokenConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Each of the token's k' pairs' weighted expert output, [k', H] in x's dtype, for
    ``x`` [1, H]; ``ids`` int32 and ``weights`` float32, both contiguous [1, k']. The
    shared weights, when given, have their routed siblings' strides (the caller copies
    them otherwise). The caller sums the rows (:func:`.fused_moe.sum_pairs`)."""
    _, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    x, s13, s2, options = _launch_setup(x, w13, w2, shared13, shared2)
    h = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    block_n = _tile(config.gate_up_n, inter)
    _gate_up_one_kernel[(top_k, triton.cdiv(inter, block_n))](
        x, w13, s13, h, ids, num_experts, inter, hidden, w13.stride(0), w13.stride(1), w13.stride(2),
        BLOCK_N=block_n, BLOCK_K=_tile(config.gate_up_k, hidden), STAGES=config.gate_up_stages,
        num_warps=config.gate_up_warps, **options)
    return _down_rows(h, w2, s2, weights, ids, hidden, config, options)


def _launch_setup(x, w13, w2, shared13, shared2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """x with unit column stride, the shared weights (the first expert's standing in, unread,
    when there are none) and the launch options both kernels share."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    has_shared = shared13 is not None
    use_pdl = pdl.enabled(x.device)
    options = {"HAS_SHARED": has_shared, "ROUND": interpreted_bf16(x), "USE_PDL": use_pdl,
               **pdl.launch_options(use_pdl)}
    return x, shared13 if has_shared else w13[0], shared2 if has_shared else w2[0], options


def _down_rows(h, w2, s2, weights, ids, hidden: int, config: SingleTokenConfig, options: dict) -> torch.Tensor:
    """The down kernel's launch: the pairs' weighted rows [k', H]."""
    num_experts, _, inter = w2.shape
    top_k = h.shape[0]
    rows = torch.empty(top_k, hidden, dtype=h.dtype, device=h.device)
    block_n = _tile(config.down_n, hidden)
    _down_one_kernel[(top_k, triton.cdiv(hidden, block_n))](
        h, w2, s2, rows, weights, ids, num_experts, hidden, inter, w2.stride(0), w2.stride(1), w2.stride(2),
        BLOCK_N=block_n, BLOCK_K=_tile(config.down_k, inter), STAGES=config.down_stages,
        num_warps=config.down_warps, **options)
    return rows
