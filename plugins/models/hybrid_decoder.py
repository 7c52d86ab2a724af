"""The hybrid decoder of Qwen3-Next and Qwen3.5: Gated DeltaNet and gated attention layers.

``layer_types`` says which token mixer each layer has (released checkpoints: three
linear-attention layers, then one full-attention layer, repeated). Only full-attention
layers keep a paged KV cache; linear-attention layers keep a fixed-size recurrent state
per sequence slot, allocated by :meth:`HybridLM.allocate_state` and addressed through
``ForwardBatch.state_slots``. Every norm on the residual stream is zero-centred.
"""

from __future__ import annotations

from typing import Iterable

import torch
from loguru import logger
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.interface import AttentionSpec
from ninfer_plugins.models.decoder import default_dtype
from ninfer_plugins.models.gated_attention import GatedAttention
from ninfer_plugins.models.gated_deltanet import GatedDeltaNet
from ninfer_plugins.models.hybrid_config import FULL, LINEAR, HybridConfig
from ninfer_plugins.models.hybrid_norms import ZeroCentredRMSNorm
from ninfer_plugins.models.hybrid_weights import WeightRouter, load_hybrid_weights
from ninfer_plugins.models.layers import Embedding, GatedMLP, store_linears_column_major
from ninfer_plugins.models.mtp import MtpHead
from ninfer_plugins.models.prenorm import PreNormBlock, PreNormLM
from ninfer_plugins.models.shared_moe import SharedExpertMoE


def _mlp(cfg: HybridConfig, sparse: bool) -> nn.Module:
    if sparse:
        return SharedExpertMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size,
        )
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size)


class HybridLayer(PreNormBlock):
    """Pre-norm block whose token mixer is ``linear_attn`` or ``self_attn`` (checkpoint names)."""

    def __init__(self, cfg: HybridConfig, kind: str, sparse: bool):
        super().__init__()
        self.is_linear = kind == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = _mlp(cfg, sparse)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        if self.is_linear:
            return self.linear_attn(x, batch)
        return self.self_attn(positions, x, batch, cos_sin)


class HybridStack(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            HybridLayer(cfg, kind, cfg.is_sparse(i)) for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridLM(PreNormLM):
    """Embeddings, hybrid layers, final norm, LM head; plus the MTP head when the checkpoint has one."""

    def __init__(self, cfg: HybridConfig, grouped_projections: bool):
        super().__init__()
        self.cfg = cfg
        self.grouped_projections = grouped_projections
        self.model = HybridStack(cfg)
        self._add_head(cfg, rotary_dim=cfg.rotary_dim)
        sparse_mtp = cfg.num_experts > 0
        self.mtp = MtpHead(cfg, lambda: HybridLayer(cfg, FULL, sparse_mtp)) if cfg.mtp_num_layers else None

    def _attention_layers(self) -> list[GatedAttention]:
        return [layer.self_attn for layer in self.model.layers if not layer.is_linear]

    def _linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    # -- engine contract -------------------------------------------------------
    #: decode runs without host syncs: state slots, routing and the KV write are all
    #: addressed through device tensors of the batch
    supports_cuda_graphs = True

    def attention_specs(self) -> list[AttentionSpec]:
        return [AttentionSpec(self.cfg.num_kv_heads, self.cfg.head_dim)] * len(self._attention_layers())

    def bind_kv_caches(self, caches: list) -> None:
        layers = self._attention_layers()
        if len(caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV caches (one per full-attention layer), got {len(caches)}")
        for attn, cache in zip(layers, caches):
            attn.kv_cache = cache

    def state_bytes_per_slot(self) -> int:
        return sum(layer.state_bytes_per_slot() for layer in self._linear_layers())

    def allocate_state(self, num_slots: int, device: torch.device | str) -> int:
        return sum(layer.allocate_state(num_slots, torch.device(device)) for layer in self._linear_layers())

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self._linear_layers() for t in layer.state_tensors()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        router = WeightRouter(self, self.grouped_projections, self.cfg.tie_word_embeddings, self.mtp is not None)
        if not load_hybrid_weights(weights, router) and self.mtp is not None:
            logger.info("the config declares an MTP layer but the checkpoint has no mtp.* weights; none is loaded")
            self.mtp = None
        if self.lm_head.weight.is_cuda:
            store_linears_column_major(self)  # faster decode matmuls on CUDA


def build_hybrid(
    config: dict, dtype: torch.dtype, device: torch.device | str, grouped_projections: bool = False
) -> HybridLM:
    """An unloaded model for a Hugging Face config dict, parameters on ``device``.

    ``grouped_projections``: the checkpoint fuses Gated DeltaNet's projections per key
    head (Qwen3-Next) rather than storing them separately (Qwen3.5).
    """
    with torch.device(device), default_dtype(dtype):
        return HybridLM(HybridConfig.from_hf(config), grouped_projections).eval()
