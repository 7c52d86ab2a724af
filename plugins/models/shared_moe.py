"""Mixture of experts plus an always-on shared expert, as in Qwen3-Next and Qwen3.5-MoE.

Routing is Qwen3-MoE's (:class:`ninfer_plugins.models.moe.SparseMoE`); every token also
goes through one dense SwiGLU expert whose output is scaled by a learned per-token gate,
``sigmoid(shared_expert_gate(x))``, and added to the routed experts' sum.
"""

from __future__ import annotations

import torch

from ninfer_plugins.models.layers import GatedMLP, Linear
from ninfer_plugins.models.moe import SparseMoE


class SharedExpertMoE(SparseMoE):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        shared_intermediate_size: int,
    ):
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, norm_topk_prob)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared
