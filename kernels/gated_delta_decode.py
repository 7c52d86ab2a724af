"""Reference for Gated DeltaNet's whole token mixer after the input projection, in one op.

A Gated DeltaNet layer projects each token to ``[q | k | v | z | b | a]`` (one fused
matmul), then: a causal depthwise conv (+ silu) over ``q | k | v`` with a carried
history, the gated delta rule with write strength ``sigmoid(b)`` and log-decay
``-exp(A_log) * softplus(a + dt_bias)``, an RMSNorm per value head scaled by the norm
weight and gated by ``silu(z)``. Decode (and speculative verification, a few tokens per
sequence) is a chain of small launches when done op by op; the Triton version does it
all in one. This reference chains the reference ops, which fixes what "the same" means.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels.causal_conv import causal_conv1d
from ninfer_kernels.gated_delta import gated_delta_rule
from ninfer_kernels.gated_rms_norm import gated_rms_norm


def gated_delta_decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
) -> torch.Tensor:
    """The mixer's output before ``out_proj``: [T, Hv * Dv] in ``proj``'s dtype.

    ``proj`` [T, 2*Hk*Dk + 2*Hv*Dv + 2*Hv] is ``[q | k | v | z | b | a]``; ``conv_weight``
    [C, K] with C = 2*Hk*Dk + Hv*Dv; ``conv_states`` [slots, K-1, C] (model dtype) and
    ``ssm_states`` [slots, Hv, Dk, Dv] (float32) are updated in place for each sequence's
    ``batch.state_slots`` entry; ``a_log``, ``dt_bias`` [Hv]; ``norm_weight`` [Dv]. Hv is
    ``a_log``'s length and Dv ``norm_weight``'s. Sequences are varlen as in
    :class:`ForwardBatch` (any number of tokens each; a chunk starting at position 0
    starts from zero state). A sequence whose slot is negative (graph padding) starts
    from zero state and writes no state; its output rows are finite but meaningless.

    Each step rounds where the layer's op-by-op chain rounds (conv output, ``sigmoid(b)``,
    the delta rule's output and the normalised rows in the model dtype; the decay, the
    gate and the accumulations in float32), so this equals that chain exactly. Rows past
    the last sequence come back as zeros, as the chained ops give.
    """
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    num_v_heads, head_v_dim = a_log.shape[0], norm_weight.shape[0]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    tokens = proj.shape[0]
    qkv, z, b, a = proj.split([2 * key_dim + value_dim, value_dim, num_v_heads, num_v_heads], dim=-1)
    # The chain runs on working copies of the step's slots (zeros for a negative one), so a
    # padding sequence starts from zero state and nothing is written for it.
    slots = batch.state_slots.tolist()
    live = [i for i, s in enumerate(slots) if s >= 0]
    conv_work = _gather(conv_states, slots)
    ssm_work = _gather(ssm_states, slots)
    work_batch = dataclasses.replace(batch, state_slots=torch.arange(len(slots), device=proj.device))

    qkv = causal_conv1d(qkv, conv_weight.reshape(conv_weight.shape[0], -1), conv_work, work_batch)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    out = gated_delta_rule(
        q.reshape(tokens, num_k_heads, head_k_dim),
        k.reshape(tokens, num_k_heads, head_k_dim),
        v.reshape(tokens, num_v_heads, head_v_dim),
        g,
        beta,
        ssm_work,
        work_batch,
    )
    out = gated_rms_norm(out.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim), norm_weight, eps)

    if live:
        index = torch.tensor(live, device=proj.device)
        targets = torch.tensor([slots[i] for i in live], device=proj.device)
        conv_states.index_copy_(0, targets, conv_work.index_select(0, index))
        ssm_states.index_copy_(0, targets, ssm_work.index_select(0, index))
    return out.reshape(tokens, value_dim)


def gated_delta_verify(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
    batch: ForwardBatch,
    position_rows: torch.Tensor,
) -> torch.Tensor:
    """Speculative verify rows: :func:`gated_delta_decode` for sequences of ``W`` tokens
    each (``W = position_rows.shape[1]``), except where the state goes.

    Each sequence's ``batch.state_slots`` entry is only read; the conv history and delta
    state after its token ``j`` are written to row ``position_rows[i, j]`` (int64
    [num_seqs, W]) of the same pools, so the state after any prefix of the tokens can be
    kept and the rest dropped. Every sequence continues cached history (verify rows
    follow a committed token). This reference runs the tokens as ``W`` one-token decode
    steps, each starting from a copy of the previous position's row: the per-position
    states are then those plain decode would reach.
    """
    num_seqs, width = position_rows.shape
    if proj.shape[0] != num_seqs * width:
        raise ValueError(f"{num_seqs} sequences of {width} verify rows need {num_seqs * width} projection rows")
    rows = proj.reshape(num_seqs, width, -1)
    one = torch.arange(num_seqs + 1, dtype=batch.query_start.dtype, device=proj.device)
    outs, source = [], batch.state_slots
    for t in range(width):
        target = position_rows[:, t]
        for pool in (conv_states, ssm_states):
            pool.index_copy_(0, target, pool.index_select(0, source))
        lens = [n - width + t + 1 for n in batch.seq_lens_host]
        step = dataclasses.replace(
            batch, query_start=one, seq_lens=torch.tensor(lens, dtype=batch.seq_lens.dtype, device=proj.device),
            max_query_len=1, max_seq_len=max(lens), query_lens_host=[1] * num_seqs, seq_lens_host=lens,
            state_slots=target, verify=None,
        )
        outs.append(gated_delta_decode(rows[:, t].contiguous(), conv_weight, conv_states, ssm_states, a_log, dt_bias,
                                       norm_weight, eps, num_k_heads, head_k_dim, step))
        source = target
    return torch.stack(outs, dim=1).reshape(num_seqs * width, -1)


def _gather(states: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """A copy of ``states`` at ``slots`` (in order), zeros where a slot is negative."""
    index = torch.tensor([max(s, 0) for s in slots], dtype=torch.long, device=states.device)
    dead = torch.tensor([s < 0 for s in slots], dtype=torch.bool, device=states.device)
    work = states.index_select(0, index)
    return work.masked_fill(dead.reshape(-1, *[1] * (work.dim() - 1)), 0)
