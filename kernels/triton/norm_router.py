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

:func:`rms_norm_route` (``ROUTE``) also takes the routing launch's work: each program
stores its logits, then bumps its token's arrival counter, and the program that arrives
last reads the token's whole logits row back (through L2) and picks the experts as
:mod:`.moe_route` does, from the same rounded logits, so the weights and ids are the two
launches' bit for bit; it resets the counter for the next call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_kernels.norm import NORM_ROUTER_MAX_TOKENS as MAX_TOKENS
from ninfer_kernels.triton import pdl
from ninfer_kernels.triton.counters import counter_buffer
from ninfer_kernels.triton.l2_prefetch import prefetch_l2_bulk
from ninfer_kernels.triton.moe_route import pick_experts
from ninfer_kernels.triton.rounding import interpreted_bf16, round_to

#: router rows a program takes (the 35B-A3B's 256 experts: 64 programs a token); a router
#: laid out column-major (CUDA models' layout for cuBLAS, which the MoE blocks no longer give
#: their routers: that read measured slower, docs/moe.md) takes 16, so that a block's values
#: at one hidden index fill a 32-byte sector (16 programs a token)
BLOCK_E = 4
BLOCK_E_COLUMN_MAJOR = 16


@triton.jit
def _norm_router_kernel(
    x_ptr, res_ptr, w_ptr, router_ptr, gate_ptr, out_ptr, sum_ptr, logits_ptr, rw_ptr, ids_ptr, count_ptr,
    pf_ptr, pf_shared_ptr, num_experts, eps, stride_x, stride_r, stride_re, stride_rh, stride_l,
    pf_stride_e, pf_bytes, pf_chunk,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, HAS_GATE: tl.constexpr, USE_PDL: tl.constexpr,
    ROUND: tl.constexpr, ROUTE: tl.constexpr = False, TOP_K: tl.constexpr = 1, K_OUT: tl.constexpr = 1,
    RENORM: tl.constexpr = False, BLOCK_ALL: tl.constexpr = 16, BLOCK_KO: tl.constexpr = 2,
    PREFETCH: tl.constexpr = False, PF_CHUNKS: tl.constexpr = 1,
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
    if ROUTE:
        tl.debug_barrier()  # every thread's logits are stored before the counter moves
        counter = count_ptr + t
        if tl.atomic_add(counter, 1, sem="acq_rel") == last_block:  # the token's last program
            every = tl.arange(0, BLOCK_ALL)
            every_ok = every < num_experts
            row = logits_ptr + t * stride_l
            logits_all = tl.load(row + every, mask=every_ok, other=float("-inf"), cache_modifier=".cg")
            gate_logit = 0.0
            if HAS_GATE:
                gate_logit = tl.load(row + num_experts, cache_modifier=".cg").to(tl.float32)
            ids = pick_experts(logits_all.to(tl.float32), every_ok, gate_logit, rw_ptr + t * K_OUT,
                               ids_ptr + t * K_OUT, num_experts, TOP_K, K_OUT, RENORM, HAS_GATE, BLOCK_ALL, BLOCK_KO)
            tl.store(counter, 0)
            if PREFETCH:  # the chosen experts' gate/up bytes into L2, PF_CHUNKS ranges each
                _prefetch_experts(ids, pf_ptr, pf_shared_ptr, num_experts, pf_stride_e, pf_bytes, pf_chunk, K_OUT,
                                  HAS_GATE, BLOCK_KO, PF_CHUNKS)


@triton.jit
def _prefetch_experts(ids, pf_ptr, pf_shared_ptr, num_experts, pf_stride_e, pf_bytes, pf_chunk, K_OUT: tl.constexpr,
                      HAS_GATE: tl.constexpr, BLOCK_KO: tl.constexpr, PF_CHUNKS: tl.constexpr):
    """Ask L2 for the gate/up weights of experts ``ids`` (bytes: ``pf_ptr`` is a byte view;
    id ``num_experts``, the shared expert, at ``pf_shared_ptr``), each in ``PF_CHUNKS``
    ranges of ``pf_chunk`` bytes, so the expert kernel's first reads find them on the way."""
    ko = tl.arange(0, BLOCK_KO)
    base = pf_ptr + ids.to(tl.int64) * pf_stride_e
    if HAS_GATE:
        base = tl.where(ids == num_experts, pf_shared_ptr + tl.zeros([BLOCK_KO], tl.int64), base)
    offs = tl.arange(0, PF_CHUNKS).to(tl.int64) * pf_chunk
    size = tl.minimum(pf_chunk, pf_bytes - offs)
    ok = (ko < K_OUT)[:, None] & (size > 0)[None, :]
    sizes = tl.zeros([BLOCK_KO, PF_CHUNKS], tl.int64) + size[None, :]
    prefetch_l2_bulk(base[:, None] + offs[None, :], sizes, ok)


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
    out, new_residual, logits, _ = _launch(x, residual, weight, eps, router, shared_gate, None, False)
    return out, new_residual, logits


def rms_norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_gate: torch.Tensor | None = None,
    prefetch: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ninfer_kernels.norm.rms_norm_route` (one launch). ``prefetch``:
    ``(gate_up [E, 2I, H], the shared expert's [2I, H] or None)``, whose chosen experts the
    routing program asks L2 for (with PDL only: on a GPU)."""
    num_experts = router.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    out, new_residual, _, routing = _launch(x, residual, weight, eps, router, shared_gate, top_k, renormalize,
                                            prefetch)
    return (out, new_residual, *routing)


#: bytes of one bulk prefetch (a lane's range) when the routing program asks for the experts
PREFETCH_CHUNK = 1 << 16


def _prefetch_args(prefetch: tuple | None, use_pdl: bool) -> tuple:
    """(flag, byte view of the experts, of the shared expert, stride between experts, bytes an
    expert, bytes a range, ranges an expert) for the kernel; the flag off unless PDL is on and
    the weights are plain, contiguous tensors."""
    experts, shared = prefetch if prefetch is not None else (None, None)
    plain = isinstance(experts, torch.Tensor) and experts.dim() == 3 and experts[0].is_contiguous()
    if shared is not None:  # any dense layout (a CUDA linear's is column-major): one range of bytes
        dense = isinstance(shared, torch.Tensor) and shared.numel() == experts[0].numel() if plain else False
        shared = (shared if shared.is_contiguous() else shared.t() if shared.t().is_contiguous() else None) \
            if dense else None
        plain = shared is not None
    if not (use_pdl and plain):
        return False, None, None, 0, 0, 16, 1
    nbytes = experts[0].numel() * experts.element_size()
    chunks = triton.next_power_of_2(triton.cdiv(nbytes, PREFETCH_CHUNK))
    chunk = triton.cdiv(triton.cdiv(nbytes, chunks), 16) * 16
    as_bytes = experts.view(torch.uint8)
    shared_bytes = shared.view(torch.uint8) if shared is not None else as_bytes
    return True, as_bytes, shared_bytes, experts.stride(0) * experts.element_size(), nbytes, chunk, chunks


def _launch(x, residual, weight, eps, router, shared_gate, top_k: int | None, renormalize: bool,
            prefetch: tuple | None = None) -> tuple:
    """(out, new_residual, logits, (weights, ids) when routing with ``top_k`` else None)."""
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
    route = top_k is not None
    k_out = (top_k or 0) + has_gate
    routing = (torch.empty(tokens, k_out, dtype=torch.float32, device=x.device),
               torch.empty(tokens, k_out, dtype=torch.int32, device=x.device)) if route else None
    if tokens == 0:
        return out, new_residual, logits, routing
    gate = shared_gate.reshape(-1).contiguous() if has_gate else router
    use_pdl = pdl.enabled(x.device)
    column_major = router.stride(1) != 1
    block_e = BLOCK_E_COLUMN_MAJOR if column_major else BLOCK_E
    # one arrival counter a token (reset by its last program), allocated before any capture
    counters = counter_buffer("rms_norm_route", x.device, MAX_TOKENS, MAX_TOKENS) if route else out
    weights, ids = routing if route else (out, out)
    pf, pf_experts, pf_shared, pf_stride, pf_bytes, pf_chunk, pf_chunks = _prefetch_args(prefetch if route else None,
                                                                                         use_pdl)
    _norm_router_kernel[(tokens, triton.cdiv(num_experts, block_e))](
        x, residual, weight.contiguous(), router, gate, out, new_residual, logits, weights, ids, counters,
        pf_experts if pf else out, pf_shared if pf else out,
        num_experts, eps, x.stride(0), residual.stride(0), router.stride(0), router.stride(1), logits.stride(0),
        pf_stride, pf_bytes, pf_chunk,
        N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_E=block_e, HAS_GATE=has_gate, USE_PDL=use_pdl,
        ROUND=interpreted_bf16(x), ROUTE=route, TOP_K=top_k or 1, K_OUT=max(k_out, 1), RENORM=renormalize,
        BLOCK_ALL=triton.next_power_of_2(num_experts), BLOCK_KO=triton.next_power_of_2(max(k_out, 2)),
        PREFETCH=pf, PF_CHUNKS=pf_chunks,
        num_warps=8 if column_major else 4, **pdl.launch_options(use_pdl),
    )
    return out, new_residual, logits, routing
