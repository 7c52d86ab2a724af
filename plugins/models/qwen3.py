"""The Qwen3 dense family (``Qwen3ForCausalLM``)."""

from __future__ import annotations

from ninfer.hookspecs import hookimpl
from ninfer.model.family import ModelFamily, SamplingDefaults, SamplingPresets
from ninfer_plugins.models.decoder import build_decoder
from ninfer_plugins.models.tiny import tiny_base_config, tiny_decoder_weights


def qwen3_presets(config: dict) -> SamplingPresets:
    """The sampler settings the Qwen3 model cards recommend for each mode."""
    return SamplingPresets(
        thinking=SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0),
        non_thinking=SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    )


def tiny_config() -> dict:
    # untied LM head here; the MoE tiny checkpoint covers the tied path
    return {**tiny_base_config("Qwen3ForCausalLM", "qwen3"), "tie_word_embeddings": False, "max_window_layers": 3}


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    build=build_decoder,
    presets=qwen3_presets,
    tiny_config=tiny_config,
    tiny_weights=tiny_decoder_weights,
    reasoning_parser="qwen3",
    tool_parser="hermes_json",
    description="Qwen3 dense decoder (GQA, q/k RMSNorm)",
)


@hookimpl
def register_model_families(register) -> None:
    register(FAMILY)
