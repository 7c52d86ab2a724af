"""The Qwen3-style decoder-only model shared by the dense and mixture-of-experts families."""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from ninfer.model.forward_batch import ForwardBatch
from ninfer.model.interface import AttentionSpec
from ninfer_plugins.models.config import DecoderConfig
from ninfer_plugins.models.layers import Attention, Embedding, GatedMLP, RMSNorm, store_linears_column_major
from ninfer_plugins.models.moe import Experts, SparseMoE
from ninfer_plugins.models.prenorm import PreNormBlock, PreNormLM
from ninfer_plugins.models.weight_sink import WeightSink

# checkpoint tensors that live inside one of our fused or stacked parameters
_FUSED_NAME = re.compile(r"^(?P<module>.+)\.(?P<proj>[qkv]_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$")
_EXPERT_NAME = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
# tensors some checkpoints carry that the model recomputes
_IGNORED_NAME = re.compile(r"\.rotary_emb\.inv_freq$")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class DecoderLayer(PreNormBlock):
    """Qwen3's block: GQA attention, then a dense or sparse MLP."""

    def __init__(self, cfg: DecoderConfig, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, x, batch, cos_sin)


class DecoderStack(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self._mlp(cfg, i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def _mlp(cfg: DecoderConfig, layer: int) -> nn.Module:
        if cfg.is_sparse(layer):
            return SparseMoE(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
            )
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)


class DecoderLM(PreNormLM):
    """Embeddings, pre-norm decoder layers, final norm and LM head (optionally tied)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderStack(cfg)
        self._add_head(cfg, rotary_dim=cfg.head_dim)

    # -- engine contract -------------------------------------------------------
    #: decode runs without host syncs (MoE routing included), so steps can be captured
    supports_cuda_graphs = True

    def attention_specs(self) -> list[AttentionSpec]:
        return [AttentionSpec(self.cfg.num_kv_heads, self.cfg.head_dim)] * self.cfg.num_layers

    def bind_kv_caches(self, caches: list) -> None:
        if len(caches) != self.cfg.num_layers:
            raise ValueError(f"expected {self.cfg.num_layers} KV caches, got {len(caches)}")
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.kv_cache = cache

    # -- checkpoint loading ----------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every checkpoint tensor into place; fail on unknown names and on gaps.

        Accepts separate q/k/v and gate/up projections (fused here), and experts either
        one tensor per expert (Hugging Face hub checkpoints) or already stacked. A value may
        be a quantized weight (a weight-format plugin's, see :mod:`ninfer.model.weight_format`):
        the layer then becomes quantized (:mod:`ninfer_plugins.models.weight_sink`).
        """
        sink = WeightSink(self)
        with torch.no_grad():
            for name, value in weights:
                target = self._route(name, sink.params, sink.modules)
                if target is not None:
                    sink.put(name, *target, value)
            sink.finish()
        if self.lm_head.weight.is_cuda:
            store_linears_column_major(self)  # faster decode matmuls on CUDA

    def _route(
        self, name: str, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
    ) -> tuple[str, tuple] | None:
        """Our (parameter name, index) for a checkpoint tensor, or None to skip it."""
        if name in params:
            return name, ()
        if _IGNORED_NAME.search(name) or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        if (m := _EXPERT_NAME.match(name)) and isinstance(modules.get(m["module"]), Experts):
            param, index = modules[m["module"]].expert_slice(int(m["expert"]), m["proj"])
            return f"{m['module']}.{param}", index
        if (m := _FUSED_NAME.match(name)) and hasattr(modules.get(m["module"]), "fused_shards"):
            shards = modules[m["module"]].fused_shards()
            if m["proj"] in shards:
                fused, rows = shards[m["proj"]]
                return f"{m['module']}.{fused}.{m['kind']}", (rows,)
        raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")


def build_decoder(config: dict, dtype: torch.dtype, device: torch.device | str) -> DecoderLM:
    """An unloaded model for a Hugging Face config dict, parameters on ``device``."""
    with torch.device(device), default_dtype(dtype):
        return DecoderLM(DecoderConfig.from_hf(config)).eval()
