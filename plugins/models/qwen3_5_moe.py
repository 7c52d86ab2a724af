"""The Qwen3.5 / Qwen3.6 mixture-of-experts family, text path (``Qwen3_5MoeForConditionalGeneration``)."""

from __future__ import annotations

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.family import ModelFamily
from ninfer_plugins.models.hybrid_decoder import build_hybrid
from ninfer_plugins.models.hybrid_tiny import random_mtp_weights, tiny_hybrid_weights, tiny_moe_fields, tiny_text_config
from ninfer_plugins.models.qwen3_5 import nested_tiny_config, qwen3_5_presets


def tiny_config() -> dict:
    """Every layer routed (the released layout has no dense layers nor a top-k renorm switch)."""
    text = {**tiny_text_config("qwen3_5_moe_text"), **tiny_moe_fields(), "output_router_logits": False,
            "router_aux_loss_coef": 0.001}
    text.pop("intermediate_size")
    return nested_tiny_config("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", text)


def tiny_weights(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Experts stacked (``experts.gate_up_proj`` [E, 2I, H]), as Qwen3.5-MoE checkpoints store them."""
    return tiny_hybrid_weights(config, generator, grouped=False, stacked_experts=True)


def random_extras(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return random_mtp_weights(config, generator, grouped=False, stacked_experts=True)


FAMILY = ModelFamily(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    build=build_hybrid,
    presets=qwen3_5_presets,
    tiny_config=tiny_config,
    tiny_weights=tiny_weights,
    random_extras=random_extras,
    reasoning_parser="qwen3",
    tool_parser="qwen3_xml",
    description="Qwen3.5 / Qwen3.6 mixture-of-experts hybrid decoder (shared expert), text path",
)


@hookimpl
def register_model_families(register) -> None:
    register(FAMILY)
