"""Mixture of experts plus an always-on shared expert, as in Qwen3-Next and Qwen3.5-MoE.

Routing is Qwen3-MoE's (:class:`ninfer_plugins.models.moe.SparseMoE`); every token also
goes through one dense SwiGLU expert whose output is scaled by a learned per-token gate,
``sigmoid(shared_expert_gate(x))``, and added to the routed experts' sum.

When the shared expert is as wide as a routed one (every released checkpoint), it runs
inside the fused expert kernel as one more expert that every token picks, with its gate
as the routing weight: one launch less for each of its four matmuls and the sigmoid. It
keeps its own modules and weights, so checkpoints and LoRA adapters name it as usual; an
adapter on it (or on its gate) sends the block back to the separate path.
"""

from __future__ import annotations

import torch

from ninfer_kernels import quant_rows
from ninfer_plugins.models.layers import ExpertRows, GatedMLP, Linear
from ninfer_plugins.models.moe import SparseMoE
from ninfer_plugins.models.quant_linear import QuantLinear


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
        self.shared_expert_gate.quantizable = False  # the routing op reads its row
        # as wide as a routed expert: the expert kernel can run it, reading it like a routed one
        self.fits_expert_kernel = shared_intermediate_size == intermediate_size
        self.shared_expert.gate_up_proj.keep_row_major = self.fits_expert_kernel
        self.shared_expert.down_proj.keep_row_major = self.fits_expert_kernel

    def weight_bytes_read(self, num_tokens: int) -> int:
        shared = sum(p.nbytes for p in (*self.shared_expert.parameters(), self.shared_expert_gate.weight))
        return super().weight_bytes_read(num_tokens) + shared

    def _shared_in_kernel(self) -> tuple | None:
        """The shared expert's two projections as the expert kernel takes them (dense weights,
        or single quantized weights in the routed experts' layout), or None when it must run
        on its own (another width, a LoRA adapter, segments, a layout the experts lack)."""
        if not self.fits_expert_kernel or self.shared_expert_gate.lora is not None:
            return None
        found = [_kernel_weight(self.shared_expert.gate_up_proj), _kernel_weight(self.shared_expert.down_proj)]
        if any(w is None for w in found):
            return None
        routed = self.experts.gate_up_proj
        quantized = [quant_rows.is_quantized(w) for w in found]
        if any(quantized) and not (all(quantized) and all(type(w) is type(routed) for w in found)):
            return None
        return tuple(found)

    def _kernel_only_plan(self) -> tuple | None:
        in_kernel = self._shared_in_kernel()
        return None if in_kernel is None else (self.shared_expert_gate.weight[0], in_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor | ExpertRows:
        in_kernel = self._shared_in_kernel()
        if in_kernel is None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return self.routed(x) + shared
        weights, ids = self.route(x, self.shared_expert_gate.weight[0])
        return self._expert_rows(x, weights, ids, in_kernel)


def _kernel_weight(layer) -> object | None:
    """A projection's weight as the expert kernel reads it: a dense one without an adapter,
    or a quantized layer's single segment (no bias)."""
    if isinstance(layer, Linear):
        return layer.weight if layer.lora is None else None
    if isinstance(layer, QuantLinear) and len(layer.segments) == 1 and layer.bias is None:
        return layer.segments[0]
    return None
