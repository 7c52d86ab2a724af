"""Sparse mixture-of-experts block (Qwen3-MoE routing: softmax, top-k, optional renorm).

Experts are stored stacked, ``gate_up_proj`` [E, 2I, H] (gate rows first) and
``down_proj`` [E, H, I], which is also transformers 5's in-memory layout; checkpoints
with one tensor per expert are copied into slices at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_kernels import ops
from ninfer_plugins.models.layers import Linear, empty_param


def expert_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight * expert(x)``.

    ``x`` [T, H]; ``weights``/``ids`` [T, k]. The T*k (token, expert) pairs are sorted by
    expert so every expert that received tokens runs one contiguous matmul pair; the
    loop is over experts, never over tokens. Reading the per-expert counts is one
    host sync per call.
    """
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    token_of = order // ids.shape[1]
    rows = x[token_of]
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chunk = slice(start, start + count)
        hidden = ops.silu_and_mul(F.linear(rows[chunk], gate_up[expert]))
        out_rows[chunk] = F.linear(hidden, down[expert])
        start += count
    out_rows *= weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token_of, out_rows)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_param(num_experts, 2 * intermediate_size, hidden_size)
        self.down_proj = empty_param(num_experts, hidden_size, intermediate_size)

    def expert_slice(self, expert: int, proj: str) -> tuple[str, tuple]:
        """Where one expert's checkpoint projection goes: (our parameter, index into it)."""
        i = self.intermediate_size
        if proj == "gate_proj":
            return "gate_up_proj", (expert, slice(0, i))
        if proj == "up_proj":
            return "gate_up_proj", (expert, slice(i, 2 * i))
        return "down_proj", (expert,)


class SparseMoE(nn.Module):
    """Router (``gate``) plus stacked ``experts``, named as in Hugging Face checkpoints."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool
    ):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_forward(x, weights.to(x.dtype), ids, self.experts.gate_up_proj, self.experts.down_proj)
