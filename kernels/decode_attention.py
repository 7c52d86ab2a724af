"""Reference for one decode token per sequence, from raw q/k/v to attention output.

Qwen3's attention at decode does four things in a row: per-head RMSNorm on q and k,
RoPE on both, the new K/V row into its cache page, then attention over the pages.
The Triton version does all four in one launch (at batch 1 a decode step is a chain
of latency-bound small kernels, so every launch saved shows up in tokens per second);
this reference simply chains the reference ops, which fixes what "the same" means.
"""

from __future__ import annotations

import os

import torch

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.attention import output_gate, paged_attention, write_kv
from ninfer_kernels.qk_norm_rope import qk_norm_rope


#: with ``NINFER_FUSED_VERIFY=1``, verify rows take the one-launch path up to this many
#: tokens a sequence (k = 5 drafts) and this many (token, query head) rows per KV head (the
#: Triton program's tile)
MAX_ROWS, MAX_GROUP_ROWS = 6, 32
#: Off by default: in whole speculative rounds on an H100 (session 35) the one-launch kernel
#: with 4 rows a sequence took 33 us a layer on ``train-gpu-deep``'s shape where the four
#: unfused launches took 14, and the 27B's verify step cost 1.073 decode steps with it
#: against 1.033 without (512 keys). ``scripts/gpu_verify_attention_sweep.py`` times it alone.
FUSED_VERIFY = os.environ.get("NINFER_FUSED_VERIFY", "0") == "1"


def fits_rows(group: int, rows: int, fused_verify: bool | None = None) -> bool:
    """Whether a batch whose sequences each bring ``rows`` new tokens takes the one-launch
    path, for ``group`` query heads per KV head. A decode step always does; several rows a
    sequence only when fused verify is on (``fused_verify``, by default
    ``NINFER_FUSED_VERIFY=1``) and the rows fit the tile. Prefill chunks, and verify rows
    otherwise, take the steps one by one."""
    if rows == 1:
        return True
    on = FUSED_VERIFY if fused_verify is None else fused_verify
    return on and rows <= MAX_ROWS and group * rows <= MAX_GROUP_ROWS


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [T, H, Dv] for a batch whose B sequences each bring the same number
    of new tokens, sequence-major (T = B for decode, B * (k + 1) for speculative verify
    rows: :func:`fits_rows`), times ``sigmoid(gate)`` when a ``gate`` [T, H, Dv] is given
    (gated attention's output gate).

    ``q`` [T, H, D], ``k`` [T, Hk, D] and ``v`` [T, Hk, Dv] are the projections before the
    per-head norm and RoPE (strided views of a fused projection are fine). Row ``i``
    sits at ``positions[i]`` (its sequence's last positions, in order); its normalised,
    rotated key and its value are stored at ``batch.slot_mapping[i]`` (-1: not stored)
    before the attention reads the cache, and each row sees the keys up to its own.
    """
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin, rotary_dim)
    write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    return output_gate(paged_attention(q, k_cache, v_cache, batch, scale), gate)
