"""Reference mixture-of-experts kernels: routing, the expert-sorted row layout, the expert MLPs.

Three steps make a sparse MoE block after the router's matmul:

1. :func:`moe_route`: softmax over each token's router logits (float32), its ``top_k``
   experts, optionally renormalised to sum to one; optionally one more column for an
   always-on shared expert (id ``E``, weight ``sigmoid(x . shared_gate)``).
2. :func:`moe_align`: the (token, choice) pairs sorted by expert into runs padded to
   ``block_m`` rows, so a grouped GEMM gives each block of rows one expert. Everything is
   sized from the pair count alone, so on the GPU it runs with no host sync.
3. :func:`fused_moe`: for every pair, ``weight * down_e(silu(gate_e(x)) * up_e(x))``,
   summed over each token's pairs.

The reference favours clarity (it loops over the experts present, reading their count on
the host); the Triton versions in :mod:`ninfer_kernels.triton.fused_moe` and
:mod:`ninfer_kernels.triton.moe_route` must give the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_kernels import quant_rows
from ninfer_kernels.quant_formats import QuantWeight


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    x: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    gate_in_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights from router ``logits`` [T, E].

    Softmax in float32; the experts of the ``top_k`` largest logits in descending order
    (ties go to the lower expert id; the softmax keeps the logits' order, and ranking the
    logits keeps distinct logits apart where their float32 probabilities round equal), with
    their probabilities as weights, divided by their sum when ``renormalize``. With
    ``shared_gate`` ([H], the shared expert's gate row) and ``x`` [T, H], one more column
    follows: expert id ``E`` with weight ``sigmoid(x . shared_gate)`` (the dot in float32,
    rounded to ``x``'s dtype as a linear layer's output would be, the sigmoid in float32).

    ``gate_in_logits``: ``logits`` is [T, E + 1], its last column the shared expert's gate
    logit already rounded (:func:`ninfer_kernels.norm.rms_norm_router`); ``x`` and
    ``shared_gate`` are not needed.

    Returns ``(weights, ids)``: float32 [T, k'] and int32 [T, k'], k' = top_k (+ 1).
    """
    gate = None
    if gate_in_logits:
        logits, gate = logits[:, :-1], logits[:, -1].float()
    probs = torch.softmax(logits.float(), dim=-1)
    # a stable descending sort keeps equal logits in expert order: ties go low
    ids = logits.float().argsort(dim=-1, descending=True, stable=True)[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if shared_gate is not None and gate is None:
        if x is None:
            raise ValueError("the shared expert's gate needs x")
        gate = (x.float() @ shared_gate.reshape(-1).float()).to(x.dtype).float()
    if gate is not None:
        weights = torch.cat([weights, torch.sigmoid(gate)[:, None]], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], logits.shape[-1])], dim=1)
    return weights, ids


def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of :func:`moe_align`'s layout for ``pairs`` pairs: every run may waste up to
    ``block_m - 1`` rows, and at most ``min(num_experts, pairs)`` experts have a run."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of ``ids`` [T, k'] sorted by expert into runs padded to ``block_m`` rows.

    Pair ``p = t * k' + j`` is token ``t``'s ``j``-th choice, expert ``ids[t, j]`` in
    ``[0, num_experts)``. With ``P = T * k'`` pairs the layout has
    ``max_padded = round_up(P + min(num_experts, P) * (block_m - 1), block_m)`` rows:
    every expert that has pairs gets a run of ``ceil(count / block_m) * block_m`` rows,
    runs in expert order from row 0, each holding its pairs in increasing pair order
    followed by the sentinel ``P``; rows after the last run hold ``P`` too.

    Returns ``(sorted_pairs, block_experts, num_padded)``: int32 [max_padded], int32
    [max_padded // block_m] (the expert of each block, -1 past the last run) and int32
    [1] (rows the runs cover).
    """
    flat = ids.flatten().long()
    pairs = flat.numel()
    rows = max_padded_rows(pairs, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=ids.device)
    block_experts = torch.full((rows // block_m,), -1, dtype=torch.int32, device=ids.device)
    for expert in flat.unique().tolist():
        members = (flat == expert).nonzero().flatten()  # increasing pair order
        start = int(starts[expert])
        sorted_pairs[start:start + members.numel()] = members.to(torch.int32)
        block_experts[start // block_m:(start + int(padded[expert])) // block_m] = expert
    num_padded = padded.sum().reshape(1).to(torch.int32)
    return sorted_pairs, block_experts, num_padded


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | QuantWeight,
    w2: torch.Tensor | QuantWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared13: torch.Tensor | None = None,
    shared2: torch.Tensor | None = None,
    summed: bool = True,
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e = ``ids[t, j]``.

    ``x`` [T, H]; ``w13`` [E, 2I, H] (per expert the gate rows, then the up rows); ``w2``
    [E, H, I]; ``weights`` float32 [T, k'] and ``ids`` int32 [T, k'] as :func:`moe_route`
    returns them. Expert id ``E`` names the shared expert, ``shared13`` [2I, H] and
    ``shared2`` [H, I] (any strides), when given. ``w13`` and ``w2`` may be quantized
    (:mod:`ninfer_kernels.quant_formats`, stacked with a leading ``E``), and so may the shared
    expert's: each expert used is then dequantized to float32, which is exactly the weight
    its format encodes.

    Rounding: each pair's ``silu(gate) * up`` is computed in float32 from float32 matmul
    results and rounded to ``x``'s dtype; its down projection is accumulated in float32,
    scaled by the weight and rounded to ``x``'s dtype; the sum over a token's pairs runs
    in float32 and is rounded once. Returns [T, H] in ``x``'s dtype; with ``summed`` false,
    the pairs' rows [T, k', H] before that sum (a residual-add norm can sum them:
    :func:`ninfer_kernels.norm.rms_norm`'s ``expert_rows``).
    """
    num_tokens, k = ids.shape
    num_experts = w13.shape[0]
    flat_ids = ids.flatten().long()
    flat_weights = weights.flatten().float()
    out_pairs = torch.empty(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in flat_ids.unique().tolist():
        if expert == num_experts:
            if shared13 is None or shared2 is None:
                raise ValueError(f"expert id {expert} names the shared expert, but none was given")
            gate_up, down = (w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)
                             for w in (shared13, shared2))
        else:
            gate_up, down = _expert_weight(w13, expert), _expert_weight(w2, expert)
        pairs = (flat_ids == expert).nonzero().flatten()
        projected = x[pairs // k].float() @ gate_up.float().T
        gate, up = projected.chunk(2, dim=-1)
        hidden = (F.silu(gate) * up).to(x.dtype)
        rows = (hidden.float() @ down.float().T) * flat_weights[pairs, None]
        out_pairs[pairs] = rows.to(x.dtype)
    rows = out_pairs.view(num_tokens, k, x.shape[1])
    return rows.float().sum(dim=1).to(x.dtype) if summed else rows


def _expert_weight(stacked: torch.Tensor | QuantWeight, expert: int) -> torch.Tensor:
    if isinstance(stacked, torch.Tensor):
        return stacked[expert]
    return quant_rows.expert(stacked, expert).dequantize(torch.float32)


def expert_loop(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """transformers' way of running the experts, an independent check of :func:`fused_moe`
    (and the path the models took before it, which the GPU scripts time against it).

    ``x`` [T, H]; ``weights``/``ids`` [T, k] (no shared column). The (token, choice) pairs
    are sorted by expert and each expert present runs one matmul pair, its output rounded
    to ``x``'s dtype before the weighted sum. Reading the per-expert counts syncs the host.
    """
    flat_ids = ids.flatten().long()
    order = flat_ids.argsort(stable=True)
    token_of = order // ids.shape[1]
    rows = x[token_of]
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chunk = slice(start, start + count)
        gate, up = F.linear(rows[chunk], w13[expert]).float().chunk(2, dim=-1)
        out_rows[chunk] = F.linear((F.silu(gate) * up).to(x.dtype), w2[expert])
        start += count
    out_rows *= weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out_rows)
