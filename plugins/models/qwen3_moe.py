"""The Qwen3 mixture-of-experts family (``Qwen3MoeForCausalLM``)."""

from __future__ import annotations

from ninfer.hookspecs import hookimpl
from ninfer.model.family import ModelFamily
from ninfer_plugins.models.decoder import build_decoder
from ninfer_plugins.models.qwen3 import qwen3_presets
from ninfer_plugins.models.tiny import tiny_base_config, tiny_decoder_weights


def tiny_config() -> dict:
    """8 experts, top-2, renormalised; layer 1 stays dense so both MLP kinds are exercised."""
    return {
        **tiny_base_config("Qwen3MoeForCausalLM", "qwen3_moe"),
        "tie_word_embeddings": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


FAMILY = ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    build=build_decoder,
    presets=qwen3_presets,
    tiny_config=tiny_config,
    tiny_weights=tiny_decoder_weights,
    reasoning_parser="qwen3",
    tool_parser="hermes_json",
    description="Qwen3 mixture-of-experts decoder (softmax top-k routing)",
)


@hookimpl
def register_model_families(register) -> None:
    register(FAMILY)
