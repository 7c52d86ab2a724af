"""The decoder hyper-parameters Qwen3-style families read from a Hugging Face config.json."""

from __future__ import annotations

from typing import Any

import attrs


def rope_settings(config: dict[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from either config layout.

    Older checkpoints (all Qwen3 releases) keep ``rope_theta`` and ``rope_scaling`` at the
    top level; transformers 5 writes both inside ``rope_parameters``. ``scaling`` is None
    for plain RoPE, else a dict carrying ``rope_type`` and that type's fields.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


@attrs.frozen
class DecoderConfig:
    """Everything the shared decoder layers need, with Qwen3 defaults for absent keys."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool
    # mixture-of-experts fields; num_experts == 0 means every layer is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "DecoderConfig":
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        heads = config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config.get("intermediate_size", 0),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_positions=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            # transformers 5 saves the expert count as num_local_experts
            num_experts=config.get("num_experts", config.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=config.get("num_experts_per_tok", 0),
            moe_intermediate_size=config.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` uses the expert block rather than a dense MLP (same rule as transformers)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )
