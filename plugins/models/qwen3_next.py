"""The Qwen3-Next family (``Qwen3NextForCausalLM``): hybrid Gated DeltaNet / gated attention, MoE."""

from __future__ import annotations

from functools import partial

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.family import ModelFamily
from ninfer_plugins.models.hybrid_decoder import build_hybrid
from ninfer_plugins.models.hybrid_tiny import tiny_hybrid_weights, tiny_moe_fields, tiny_text_config
from ninfer_plugins.models.qwen3 import qwen3_presets


def tiny_config() -> dict:
    """Top-level config in the released layout (rope keys at the top, interval-derived layer types);
    layer 1 keeps a dense MLP so both MLP kinds run."""
    return {
        **tiny_text_config("qwen3_next"),
        **tiny_moe_fields(),
        "architectures": ["Qwen3NextForCausalLM"],
        "full_attention_interval": 3,
        "rope_theta": 1000000.0,
        "partial_rotary_factor": 0.25,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "float32",
    }


def tiny_weights(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return tiny_hybrid_weights(config, generator, grouped=True, stacked_experts=False)


FAMILY = ModelFamily(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    build=partial(build_hybrid, grouped_projections=True),
    presets=qwen3_presets,
    tiny_config=tiny_config,
    tiny_weights=tiny_weights,
    reasoning_parser="qwen3",
    tool_parser="hermes_json",
    description="Qwen3-Next hybrid decoder (Gated DeltaNet + gated attention, MoE with shared expert)",
)


@hookimpl
def register_model_families(register) -> None:
    register(FAMILY)
