"""Random tiny checkpoints for the Qwen3 families, in Hugging Face tensor names.

The scales were tuned by looking at greedy output. Layer weights are large next to the
embeddings so each layer's output outweighs the token's own embedding (otherwise a tied
LM head just predicts the input token again and greedy text repeats one token); the
embedding and LM-head scale puts logits a couple of units apart, so near-ties between
the top tokens are rare; norm weights sit near 1 with jitter so a misapplied norm shows;
router logits are spread so top-k expert choices are not decided by float rounding.
"""

from __future__ import annotations

import torch

from ninfer_plugins.models.config import DecoderConfig

EMBED_STD = 0.25
LINEAR_STD = 0.3
ROUTER_STD = 0.5
NORM_JITTER = 0.1


def tiny_base_config(architecture: str, model_type: str) -> dict:
    """Shape and settings shared by both tiny families (hidden 64, 4 heads of 16, 2 KV heads)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": 256,  # ninfer-make-tiny replaces this with the tokenizer's padded size
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def tiny_decoder_weights(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of ``config`` holds, drawn from ``generator`` in a fixed order.

    Experts are written one tensor per expert, the layout of released Qwen3-MoE checkpoints.
    """
    cfg = DecoderConfig.from_hf(config)

    def randn(*shape: int, std: float = LINEAR_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + randn(dim, std=NORM_JITTER)

    h, d = cfg.hidden_size, cfg.head_dim
    weights = {"model.embed_tokens.weight": randn(cfg.vocab_size, h, std=EMBED_STD)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm(h)
        weights[p + "self_attn.q_proj.weight"] = randn(cfg.num_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = randn(cfg.num_kv_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = randn(cfg.num_kv_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = randn(h, cfg.num_heads * d)
        weights[p + "self_attn.q_norm.weight"] = norm(d)
        weights[p + "self_attn.k_norm.weight"] = norm(d)
        weights[p + "post_attention_layernorm.weight"] = norm(h)
        if cfg.is_sparse(layer):
            weights[p + "mlp.gate.weight"] = randn(cfg.num_experts, h, std=ROUTER_STD)
            for e in range(cfg.num_experts):
                weights.update(_mlp(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size, randn))
        else:
            weights.update(_mlp(p + "mlp.", h, cfg.intermediate_size, randn))
    weights["model.norm.weight"] = norm(h)
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = randn(cfg.vocab_size, h, std=EMBED_STD)
    return weights


def _mlp(prefix: str, hidden: int, intermediate: int, randn) -> dict[str, torch.Tensor]:
    return {
        prefix + "gate_proj.weight": randn(intermediate, hidden),
        prefix + "up_proj.weight": randn(intermediate, hidden),
        prefix + "down_proj.weight": randn(hidden, intermediate),
    }
