"""Reference paged-attention kernels: scatter new K/V into pages, attend over them.

Caches are laid out ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's
flat slot is ``block * block_size + offset``. These functions are the oracle the
Triton kernels are checked against, so they favour obvious correctness, but they
still work per sequence (one gather, one fused attention call) rather than per token
so CPU runs stay quick.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` [T, num_kv_heads, head_dim] at flat slots [T], in place.

    Slots equal to -1 mark padding rows and are never written.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # view() (not reshape) so a non-contiguous cache fails loudly instead of
    # silently writing into a copy.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def output_gate(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``out * sigmoid(gate)``: the per-element output gate of Qwen3-Next / Qwen3.5 gated
    attention (``gate`` [T, heads, Dv], any row strides), or ``out`` itself without one.
    The decode kernels and the paged kernel (with the bf16 cache) apply it as they store
    their output, saving the model the launches of the sigmoid and the product a layer."""
    return out if gate is None else out * torch.sigmoid(gate)


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence, contiguous: [seq_len, Hk, ...]."""
    block_size = cache.shape[1]
    num_pages = -(-seq_len // block_size)
    pages = cache.index_select(0, block_table[:num_pages])
    return pages.flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    gate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of varlen queries [T, num_heads, head_dim] over paged K/V, times
    ``sigmoid(gate)`` with a ``gate`` [T, num_heads, head_dim_v] (:func:`output_gate`).

    Row ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and sees
    that sequence's cached tokens up to and including it, so decode steps, prefill
    chunks over a cached prefix and mixtures of both share one code path. Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
    Math runs in float32; the result has ``q``'s dtype. Rows past the last sequence
    (padding) come back as zeros.
    """
    out = attend_pages(q, lambda table, n: gather_pages(k_cache, table, n),
                       lambda table, n: gather_pages(v_cache, table, n), k_cache.shape[2], batch, scale)
    return output_gate(out, gate)


#: reads one sequence's first ``seq_len`` cached keys or values: (block table, seq_len) -> [S, Hk, D]
PageReader = Callable[[torch.Tensor, int], torch.Tensor]


def attend_pages(q: torch.Tensor, read_k: PageReader, read_v: PageReader, num_kv_heads: int, batch: ForwardBatch,
                 scale: float) -> torch.Tensor:
    """:func:`paged_attention` with the cache behind readers (a quantized format dequantizes there)."""
    num_tokens, num_heads, _ = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    out: Optional[torch.Tensor] = None

    starts = itertools.accumulate(batch.query_lens_host, initial=0)
    for i, (start, q_len, seq_len) in enumerate(zip(starts, batch.query_lens_host, batch.seq_lens_host)):
        if q_len == 0:
            continue
        table = batch.block_tables[i]
        k = read_k(table, seq_len).float().transpose(0, 1)  # [Hk, S, D]
        v = read_v(table, seq_len).float().transpose(0, 1)  # [Hk, S, Dv]
        if out is None:
            out = torch.zeros(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
        qi = q[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        mask = None
        if q_len > 1:
            # The last query row sits at position seq_len - 1; earlier rows see less.
            positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        # torch's fused attention keeps long prefill chunks fast on CPU; enable_gqa maps
        # query head h to KV head h // group without copying K/V per query head.
        oi = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[start : start + q_len] = oi.transpose(0, 1).to(q.dtype)
    if out is None:  # no sequence has queries: the value width is the query's (no cache read)
        out = torch.zeros_like(q)
    return out
