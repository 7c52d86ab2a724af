"""The Qwen3.5 / Qwen3.6 dense family, text path (``Qwen3_5ForConditionalGeneration``).

Released checkpoints are vision-language models: the decoder's settings sit under
``text_config`` and its weights under ``model.language_model.``; the vision tower's
weights are skipped until a media plugin serves them.
"""

from __future__ import annotations

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.family import ModelFamily, SamplingDefaults, SamplingPresets
from ninfer_plugins.models.hybrid_decoder import build_hybrid
from ninfer_plugins.models.hybrid_tiny import (
    random_mtp_weights, tiny_hybrid_weights, tiny_text_config, tiny_vision_config, tiny_vocab_size,
)


def qwen3_5_presets(config: dict) -> SamplingPresets:
    """The general-purpose sampler settings of the Qwen3.5 model cards for each mode."""
    return SamplingPresets(
        thinking=SamplingDefaults(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5),
        non_thinking=SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5),
    )


def nested_tiny_config(architecture: str, model_type: str, text: dict) -> dict:
    """A vision-language config around ``text``, the layout of released Qwen3.5 checkpoints."""
    text = {
        **text,
        "vocab_size": tiny_vocab_size(),
        "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],  # sums to the 4 rotary frequencies of head_dim 32 at 0.25
            "mrope_interleaved": True,
        },
        "dtype": "float32",
    }
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": tiny_vision_config(text["hidden_size"]),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def tiny_config() -> dict:
    return nested_tiny_config("Qwen3_5ForConditionalGeneration", "qwen3_5", tiny_text_config("qwen3_5_text"))


def tiny_weights(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return tiny_hybrid_weights(config, generator, grouped=False, stacked_experts=False)


def random_extras(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return random_mtp_weights(config, generator, grouped=False, stacked_experts=False)


FAMILY = ModelFamily(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    model_types=("qwen3_5", "qwen3_5_text"),
    build=build_hybrid,
    presets=qwen3_5_presets,
    tiny_config=tiny_config,
    tiny_weights=tiny_weights,
    random_extras=random_extras,
    reasoning_parser="qwen3",
    tool_parser="qwen3_xml",
    description="Qwen3.5 / Qwen3.6 dense hybrid decoder (Gated DeltaNet + gated attention), text path",
)


@hookimpl
def register_model_families(register) -> None:
    register(FAMILY)
