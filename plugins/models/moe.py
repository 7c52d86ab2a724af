"""Sparse mixture-of-experts block (Qwen3-MoE routing: softmax, top-k, optional renorm).

Experts are stored stacked, ``gate_up_proj`` [E, 2I, H] (gate rows first) and
``down_proj`` [E, H, I], which is also transformers 5's in-memory layout; checkpoints
with one tensor per expert are copied into slices at load time.

After the router's matmul the block is two ops (:mod:`ninfer_kernels.moe`): routing
(softmax, top-k, renorm) and the fused expert MLPs. On CUDA both run on the device
without a host sync (tokens are sorted by expert there), so MoE decode steps can be
captured in CUDA graphs; prefill uses the same grouped GEMM with larger tiles.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ninfer_kernels import ops, quant_rows
from ninfer_kernels.norm import NORM_ROUTER_MAX_TOKENS
from ninfer_kernels.quant_formats import QuantWeight
from ninfer_plugins.models.layers import ExpertRows, Linear, RMSNorm, empty_param


def norm_router_enabled() -> bool:
    """Decode batches run the norm before a MoE block and its router's matmul as one op
    (:meth:`SparseMoE.from_residual`): 2.5% faster batch-1 steps on the 35B-A3B and 2.2% on
    the 30B-A3B (H100, docs/moe.md). ``NINFER_NORM_ROUTER=0`` keeps the two launches; read
    when a block is built (its router's layout follows) and per call."""
    return os.environ.get("NINFER_NORM_ROUTER", "1") != "0"


class Experts(nn.Module):
    """``gate_up_proj`` and ``down_proj``: stacked tensors, or, from a quantized checkpoint,
    stacked quantized weights (:meth:`set_quantized`) that ``ops.fused_moe`` takes as they are."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.gate_up_proj = empty_param(num_experts, 2 * intermediate_size, hidden_size, deferred=True)
        self.down_proj = empty_param(num_experts, hidden_size, intermediate_size, deferred=True)

    def set_quantized(self, proj: str, weight: QuantWeight) -> None:
        """Hold ``proj`` quantized; its tensors become parameters (so byte counts see them)."""
        del self._parameters[proj]
        setattr(self, proj, quant_rows.register_params(self, proj, weight))

    @property
    def quantized(self) -> bool:
        return not isinstance(self.gate_up_proj, torch.Tensor) or not isinstance(self.down_proj, torch.Tensor)

    def bytes_per_expert(self) -> int:
        return (quant_rows.nbytes(self.gate_up_proj) + quant_rows.nbytes(self.down_proj)) // self.num_experts

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
        self.gate.quantizable = False  # routing is decided by small logit gaps: keep it exact
        # the one op reads router rows: row-major, its programs take 4 contiguous rows each (64 a
        # token at 256 experts); column-major (CUDA's layout for cuBLAS) they need 16 rows to fill
        # a sector, so only 16 programs a token read the whole router, slower than two launches
        self.gate.keep_row_major = norm_router_enabled()
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def weight_bytes_read(self, num_tokens: int) -> int:
        """Bytes of weights a step of ``num_tokens`` tokens reads: the router, and each expert
        some token picks, counted at the number of distinct experts ``num_tokens`` uniform
        top-k draws reach on average (benchmarks' bandwidth figure)."""
        experts = self.experts.num_experts
        distinct = experts * (1 - (1 - self.top_k / experts) ** num_tokens)
        per_expert = self.experts.bytes_per_expert()
        return round(self.gate.weight.nbytes + distinct * per_expert)

    def forward(self, x: torch.Tensor) -> ExpertRows:
        """The experts' weighted rows, summed by the norm after the layer (:class:`ExpertRows`)."""
        return ExpertRows(self.routed(x, summed=False))

    def from_residual(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple:
        """``(self(n), new_residual)`` for ``n, new_residual = norm(x, residual)``. For a
        decode batch, a plain router and a block whose output is the expert kernel's alone,
        the norm and the router's matmul are one op (:func:`ninfer_kernels.ops.rms_norm_router`,
        unless :func:`norm_router_enabled` says no): one launch fewer a layer on CUDA."""
        # the block's own checks last, and only for batches the op serves
        fusable = (norm_router_enabled() and isinstance(norm, RMSNorm) and residual is not None and x.dim() == 2
                   and x.shape[0] <= NORM_ROUTER_MAX_TOKENS and self._plain_router())
        plan = self._kernel_only_plan() if fusable else None
        if plan is None:
            x, residual = norm(x, residual)
            return self(x), residual
        gate_row, shared = plan
        x, residual, logits = ops.rms_norm_router(x, residual, norm.weight, norm.eps, self.gate.weight, gate_row)
        weights, ids = ops.moe_route(logits, self.top_k, self.norm_topk_prob, gate_in_logits=gate_row is not None)
        return self._expert_rows(x, weights, ids, shared), residual

    def _expert_rows(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: tuple = ()) -> ExpertRows:
        """The chosen experts' weighted rows (``shared``: the shared expert's weights, which
        ``ids`` name as expert ``E``), left for the norm after the layer to sum."""
        return ExpertRows(ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, *shared,
                                        summed=False))

    def _kernel_only_plan(self) -> tuple | None:
        """(the shared expert's gate row or None, the shared expert's weights for the expert
        kernel) when the block's output is the expert kernel's rows alone, else None."""
        return None, ()

    def _plain_router(self) -> bool:
        """A router without an adapter or a bias: its weight goes to the routing ops as it is."""
        gate = self.gate
        return gate.lora is None and gate.bias is None and isinstance(gate.weight, torch.Tensor)

    def routed(self, x: torch.Tensor, summed: bool = True) -> torch.Tensor:
        weights, ids = self.route(x)
        return ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, summed=summed)

    def route(self, x: torch.Tensor, shared_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights (``shared_gate``: the shared expert's gate row,
        its weight appended). A plain router takes the op that fuses its matmul with the
        routing (one launch for decode batches on CUDA); one with an adapter or a bias runs
        as a layer first."""
        if self._plain_router():
            return ops.route_tokens(x, self.gate.weight, self.top_k, self.norm_topk_prob, shared_gate)
        return ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob, x, shared_gate)
