"""Gated full attention of the hybrid Qwen families, over the paged KV cache.

Like Qwen3's attention (GQA, per-head q/k RMSNorm, then RoPE) with three differences:
the q/k norms are zero-centred; RoPE turns only the first ``rotary_dim`` dims of each head
(a quarter in released checkpoints); and ``q_proj`` is twice as wide, giving each head
a query and an output gate, ``out = attention * sigmoid(gate)`` before ``o_proj``.
Checkpoint ``q_proj`` rows are per head ``[query (D) | gate (D)]``. The gate goes to the
attention as a view of the projection: the fused decode kernels apply it as they store
their output, other paths after the attention.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.kv import HeadNormRope, KVCache
from ninfer_plugins.models.hybrid_config import HybridConfig
from ninfer_plugins.models.hybrid_norms import ZeroCentredRMSNorm
from ninfer_plugins.models.layers import Linear, cached_attention


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kv_cache: KVCache | None = None

    def fused_shards(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint projection -> (our fused module, its rows that hold it)."""
        qg, kv = 2 * self.q_size, self.kv_size
        return {
            "q_proj": ("qkv_proj", slice(0, qg)),
            "k_proj": ("qkv_proj", slice(qg, qg + kv)),
            "v_proj": ("qkv_proj", slice(qg + kv, qg + 2 * kv)),
        }

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.reshape(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate.split(self.head_dim, dim=-1)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "bind_kv_caches() must run before forward()"
        norm_rope = HeadNormRope(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions, cos_sin,
                                 self.rotary_dim)
        out = cached_attention(self.kv_cache, q, k, v, norm_rope, batch, self.scale, gate=gate)
        return self.o_proj(out.reshape(tokens, self.q_size))
