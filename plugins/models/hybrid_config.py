"""Hyper-parameters of the hybrid Qwen3-Next / Qwen3.5 decoders, read from a Hugging Face config.

Qwen3-Next keeps everything at the top level of config.json. Qwen3.5 checkpoints are
vision-language models: the text decoder's settings sit under ``text_config`` (the
vision tower's under ``vision_config``, which the text path ignores).
"""

from __future__ import annotations

from typing import Any

import attrs

from ninfer_plugins.models.config import rope_settings

LINEAR, FULL = "linear_attention", "full_attention"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's settings: ``text_config`` when nested, else the config itself.

    A top-level ``max_position_embeddings`` larger than the nested one wins: that is how
    the loader extends the position tables past the trained context.
    """
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    merged = {**nested}
    for key in ("tie_word_embeddings", "max_position_embeddings"):
        if key not in merged and key in config:
            merged[key] = config[key]
    if config.get("max_position_embeddings", 0) > merged.get("max_position_embeddings", 0):
        merged["max_position_embeddings"] = config["max_position_embeddings"]
    return merged


def _layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    """Explicit ``layer_types``, else every ``full_attention_interval``-th layer is full attention."""
    layers = text["num_hidden_layers"]
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {layers} of {LINEAR!r}/{FULL!r}, got {types}")
    return tuple(types)


def _rotary_fraction(text: dict[str, Any]) -> float:
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(text.get("partial_rotary_factor", 0.25))  # the default of both model types


@attrs.frozen
class HybridConfig:
    """Everything the hybrid layers need; MoE fields stay zero for dense checkpoints."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mtp_num_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "HybridConfig":
        text = text_config(config)
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {text['hidden_act']!r} (only silu)")
        if not text.get("attn_output_gate", True):
            raise ValueError("attn_output_gate: false is not supported (every released checkpoint gates)")
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        theta, scaling = rope_settings(text)
        rotary_dim = int(head_dim * _rotary_fraction(text))
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            layer_types=_layer_types(text),
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim - rotary_dim % 2,
            rope_theta=theta,
            rope_scaling=scaling,
            max_positions=text.get("max_position_embeddings", 32768),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            intermediate_size=text.get("intermediate_size", 0),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
            num_experts=text.get("num_experts", text.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=text.get("num_experts_per_tok", 0),
            moe_intermediate_size=text.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
            # Qwen3.5-MoE always renormalises the top-k weights and has no such key
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=text.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            mtp_num_layers=text.get("mtp_num_hidden_layers", 0) or 0,
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` uses the expert block rather than a dense MLP (same rule as transformers)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )
