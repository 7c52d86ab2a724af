"""Decoder building blocks shared by the Qwen3 families.

Parameters are created with ``torch.empty`` (no random init: the checkpoint overwrites
them, and initialising a multi-billion-parameter model would cost seconds) and without
gradients. Module and parameter names follow the Hugging Face layout, except for the
fused projections (``qkv_proj``, ``gate_up_proj``) that
:class:`ninfer_plugins.models.decoder.DecoderLM` fills from the separate checkpoint
tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.kv import HeadNormRope, KVCache
from ninfer.model.weight_format import linear_weights_deferred
from ninfer_kernels import ops
from ninfer_plugins.models.config import DecoderConfig

if TYPE_CHECKING:
    from ninfer.lora.layer import LinearLora


def empty_param(*shape: int, deferred: bool = False) -> nn.Parameter:
    """An uninitialised parameter; ``deferred``: without storage (meta device) while a
    quantized checkpoint loads, which gives it storage of the right kind later."""
    device = "meta" if deferred and linear_weights_deferred() else None
    return nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with the weight stored ``[out, in]`` as in checkpoints.

    ``lora`` is set by :class:`ninfer.lora.LoraRegistry` once an adapter targets this
    layer; it adds each row's adapter delta and returns at once when no row has one.
    ``keep_row_major``: a kernel other than the matmul reads this weight and wants the
    checkpoint's row-major layout (see :func:`store_linears_column_major`).
    ``quantizable`` False keeps the layer dense when its checkpoint quantizes it (the LM
    head and routers, whose weights other code reads); otherwise the loader swaps in a
    :class:`ninfer_plugins.models.quant_linear.QuantLinear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = empty_param(out_features, in_features, deferred=True)
        self.bias = empty_param(out_features) if bias else None
        self.lora: LinearLora | None = None
        self.keep_row_major = False
        self.quantizable = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


def store_linears_column_major(model: nn.Module) -> int:
    """Keep every :class:`Linear` weight ``[out, in]`` but lay it out column-major in memory.

    ``F.linear`` then hands cuBLAS ``W^T`` as a plain row-major ``[in, out]`` matrix, and on an
    H200 its kernels for that layout read decode's skinny products faster (8B shapes: 2-12%
    per matmul, about 0.15 ms per step at batch 1; scripts in docs/performance.md). Shapes,
    names and values stay as they were. A weight shared with the input embedding keeps its
    rows contiguous, since the embedding gathers rows, and so does one marked
    ``keep_row_major``. Returns how many weights moved.
    """
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
    moved = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, Linear) or module.keep_row_major:
                continue
            if id(module.weight) not in embedding_weights:
                module.weight.data = module.weight.data.t().contiguous().t()
                moved += 1
    return moved


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = empty_param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ExpertRows(NamedTuple):
    """A mixture-of-experts layer's output left unsummed: each token's weighted expert
    rows [T, k', H]. The residual-stream norm after the layer sums them as it adds the
    residual (one launch fewer a layer); nothing else takes this type."""

    rows: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor | ExpertRows, residual: torch.Tensor | None = None):
        """Normalised ``x``, or ``(normalised x + residual, x + residual)`` with a residual
        (``x`` may be :class:`ExpertRows`, summed first)."""
        if isinstance(x, ExpertRows):
            return ops.rms_norm(x.rows, self.weight, self.eps, residual, expert_rows=True)
        return ops.rms_norm(x, self.weight, self.eps, residual)


def cached_attention(
    kv_cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_rope: HeadNormRope,
    batch: ForwardBatch, scale: float, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head q/k norm and RoPE, the KV write and attention over the cache, for q/k/v
    straight from the projection: the KV format's fused decode path when it has one for
    ``batch``, else the steps one by one. ``gate``: gated attention's output gate, applied
    inside the fused path's kernel, else after the steps."""
    out = kv_cache.decode_fused(q, k, v, norm_rope, batch, scale, gate)
    if out is not None:
        return out
    n = norm_rope
    q, k = ops.qk_norm_rope(q, k, n.q_weight, n.k_weight, n.eps, n.positions, n.cos_sin, n.rotary_dim)
    kv_cache.write(k, v, batch.slot_mapping)
    return kv_cache.attend(q, batch, scale) if gate is None else kv_cache.attend_gated(q, batch, scale, gate)


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE, over the paged KV cache."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kv_cache: KVCache | None = None

    def fused_shards(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint projection -> (our fused module, its rows that hold it)."""
        q, kv = self.q_size, self.kv_size
        return {
            "q_proj": ("qkv_proj", slice(0, q)),
            "k_proj": ("qkv_proj", slice(q, q + kv)),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
        }

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "bind_kv_caches() must run before forward()"
        norm_rope = HeadNormRope(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions, cos_sin,
                                 self.head_dim)
        out = cached_attention(self.kv_cache, q, k, v, norm_rope, batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def fused_shards(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint projection -> (our fused module, its rows that hold it)."""
        i = self.intermediate_size
        return {"gate_proj": ("gate_up_proj", slice(0, i)), "up_proj": ("gate_up_proj", slice(i, 2 * i))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
