"""Random tiny checkpoints of the hybrid families, in each family's released tensor layout.

Six layers (linear, linear, full, repeated) so that two full-attention layers share the
KV pool, two value heads per key head in Gated DeltaNet, partial RoPE, and one MTP layer.
Qwen3-Next writes fused head-grouped projections and one tensor per expert; Qwen3.5
nests the decoder under ``model.language_model.`` beside a one-block vision tower and
writes separate projections; Qwen3.5-MoE stores its experts stacked.

Scales follow :mod:`ninfer_plugins.models.tiny`, plus: decays between about 0.5 and 0.99
per token (``A_log``, ``dt_bias`` and a small ``a`` projection), so the recurrent state
carries information across many tokens and chunk boundaries; zero-centred norm weights
are jitter around 0 (a scale near 1). MLP and expert weights are half the attention
scale: with every layer's MLP at full scale the residual stream grows large enough for
float32 rounding (in transformers as in ours) to move logits by about 1e-4.
"""

from __future__ import annotations

import math

import torch

from ninfer_plugins.models.hybrid_config import LINEAR, HybridConfig
from ninfer_plugins.models.tiny import EMBED_STD, LINEAR_STD, NORM_JITTER, ROUTER_STD

BA_STD = 0.1
CONV_STD = 0.3
DT_BIAS_STD = 0.3
A_RANGE = (0.05, 0.5)
MLP_STD = 0.15
LM_HEAD_STD = 0.12


def tiny_vocab_size() -> int:
    """The vocabulary ``ninfer-make-tiny`` writes, for configs that nest it in ``text_config``."""
    from ninfer.tiny.make import VOCAB_MULTIPLE
    from ninfer.tiny.tokenizer_files import build_tokenizer

    size = build_tokenizer().get_vocab_size(with_added_tokens=True)
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tiny_text_config(model_type: str) -> dict:
    """Decoder settings shared by the three hybrid tiny families."""
    return {
        "model_type": model_type,
        "vocab_size": 256,  # replaced by the tokenizer's padded size
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
    }


def tiny_moe_fields() -> dict:
    return {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    }


def tiny_vision_config(out_hidden_size: int) -> dict:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 16,
        "out_hidden_size": out_hidden_size,
    }


class _Writer:
    """Draws tensors from one generator in a fixed order."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.tensors: dict[str, torch.Tensor] = {}

    def randn(self, name: str, *shape: int, std: float = LINEAR_STD, mean: float = 0.0) -> None:
        self.tensors[name] = torch.randn(*shape, generator=self.generator) * std + mean

    def uniform(self, low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator) * (high - low) + low

    def mlp(self, prefix: str, hidden: int, inter: int) -> None:
        self.randn(prefix + "gate_proj.weight", inter, hidden, std=MLP_STD)
        self.randn(prefix + "up_proj.weight", inter, hidden, std=MLP_STD)
        self.randn(prefix + "down_proj.weight", hidden, inter, std=MLP_STD)

    def moe(self, prefix: str, cfg: HybridConfig, stacked: bool) -> None:
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.randn(prefix + "gate.weight", e, h, std=ROUTER_STD)
        if stacked:
            self.randn(prefix + "experts.gate_up_proj", e, 2 * i, h, std=MLP_STD)
            self.randn(prefix + "experts.down_proj", e, h, i, std=MLP_STD)
        else:
            for expert in range(e):
                self.mlp(f"{prefix}experts.{expert}.", h, i)
        self.mlp(prefix + "shared_expert.", h, cfg.shared_expert_intermediate_size)
        self.randn(prefix + "shared_expert_gate.weight", 1, h, std=ROUTER_STD)

    def attention(self, prefix: str, cfg: HybridConfig) -> None:
        h, d = cfg.hidden_size, cfg.head_dim
        self.randn(prefix + "q_proj.weight", 2 * cfg.num_heads * d, h)
        self.randn(prefix + "k_proj.weight", cfg.num_kv_heads * d, h)
        self.randn(prefix + "v_proj.weight", cfg.num_kv_heads * d, h)
        self.randn(prefix + "o_proj.weight", h, cfg.num_heads * d)
        self.randn(prefix + "q_norm.weight", d, std=NORM_JITTER)
        self.randn(prefix + "k_norm.weight", d, std=NORM_JITTER)

    def deltanet(self, prefix: str, cfg: HybridConfig, grouped: bool) -> None:
        h = cfg.hidden_size
        hv = cfg.linear_num_value_heads
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = hv * cfg.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        if grouped:  # row order does not matter for random weights, only the shapes
            self.randn(prefix + "in_proj_qkvz.weight", conv_dim + value_dim, h)
            self.randn(prefix + "in_proj_ba.weight", 2 * hv, h, std=BA_STD)
        else:
            self.randn(prefix + "in_proj_qkv.weight", conv_dim, h)
            self.randn(prefix + "in_proj_z.weight", value_dim, h)
            self.randn(prefix + "in_proj_b.weight", hv, h, std=BA_STD)
            self.randn(prefix + "in_proj_a.weight", hv, h, std=BA_STD)
        self.randn(prefix + "conv1d.weight", conv_dim, 1, cfg.linear_conv_kernel, std=CONV_STD)
        self.tensors[prefix + "A_log"] = self.uniform(*A_RANGE, hv).log()
        self.randn(prefix + "dt_bias", hv, std=DT_BIAS_STD)
        self.randn(prefix + "norm.weight", cfg.linear_value_head_dim, std=NORM_JITTER, mean=1.0)
        self.randn(prefix + "out_proj.weight", h, value_dim)

    def layer(self, prefix: str, cfg: HybridConfig, linear: bool, sparse: bool, grouped: bool, stacked: bool) -> None:
        h = cfg.hidden_size
        self.randn(prefix + "input_layernorm.weight", h, std=NORM_JITTER)
        if linear:
            self.deltanet(prefix + "linear_attn.", cfg, grouped)
        else:
            self.attention(prefix + "self_attn.", cfg)
        self.randn(prefix + "post_attention_layernorm.weight", h, std=NORM_JITTER)
        if sparse:
            self.moe(prefix + "mlp.", cfg, stacked)
        else:
            self.mlp(prefix + "mlp.", h, cfg.intermediate_size)

    def vision(self, prefix: str, vision: dict) -> None:
        """A vision tower with Qwen3.5's tensor names; the text path only has to skip it."""
        hid, inter = vision["hidden_size"], vision["intermediate_size"]
        patch = vision["patch_size"]
        merged = hid * vision["spatial_merge_size"] ** 2
        self.randn(prefix + "patch_embed.proj.weight", hid, vision["in_channels"], vision["temporal_patch_size"], patch, patch)
        self.randn(prefix + "patch_embed.proj.bias", hid)
        self.randn(prefix + "pos_embed.weight", vision["num_position_embeddings"], hid)
        for block in range(vision["depth"]):
            p = f"{prefix}blocks.{block}."
            for norm in ("norm1", "norm2"):
                self.randn(f"{p}{norm}.weight", hid, std=NORM_JITTER, mean=1.0)
                self.randn(f"{p}{norm}.bias", hid, std=NORM_JITTER)
            for name, rows, cols in (("attn.qkv", 3 * hid, hid), ("attn.proj", hid, hid),
                                     ("mlp.linear_fc1", inter, hid), ("mlp.linear_fc2", hid, inter)):
                self.randn(f"{p}{name}.weight", rows, cols, std=1 / math.sqrt(cols))
                self.randn(f"{p}{name}.bias", rows, std=NORM_JITTER)
        self.randn(prefix + "merger.norm.weight", hid, std=NORM_JITTER, mean=1.0)
        self.randn(prefix + "merger.norm.bias", hid, std=NORM_JITTER)
        for name, rows, cols in (("linear_fc1", merged, merged), ("linear_fc2", vision["out_hidden_size"], merged)):
            self.randn(f"{prefix}merger.{name}.weight", rows, cols, std=1 / math.sqrt(cols))
            self.randn(f"{prefix}merger.{name}.bias", rows, std=NORM_JITTER)


def _mtp(w: _Writer, cfg: HybridConfig, grouped: bool, stacked_experts: bool) -> None:
    h = cfg.hidden_size
    w.randn("mtp.fc.weight", h, 2 * h)
    w.randn("mtp.pre_fc_norm_embedding.weight", h, std=NORM_JITTER)
    w.randn("mtp.pre_fc_norm_hidden.weight", h, std=NORM_JITTER)
    for i in range(cfg.mtp_num_layers):
        w.layer(f"mtp.layers.{i}.", cfg, False, cfg.num_experts > 0, grouped, stacked_experts)
    w.randn("mtp.norm.weight", h, std=NORM_JITTER)


def random_mtp_weights(config: dict, generator: torch.Generator, grouped: bool = False,
                       stacked_experts: bool = True) -> dict[str, torch.Tensor]:
    """The MTP head's tensors for a ``random:SHAPE`` model (transformers builds none)."""
    cfg = HybridConfig.from_hf(config)
    if not cfg.mtp_num_layers:
        return {}
    w = _Writer(generator)
    _mtp(w, cfg, grouped, stacked_experts)
    return w.tensors


def tiny_hybrid_weights(
    config: dict, generator: torch.Generator, grouped: bool, stacked_experts: bool
) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of ``config`` holds, MTP layer included, drawn in a fixed order."""
    cfg = HybridConfig.from_hf(config)
    nested = "text_config" in config
    text = "model.language_model." if nested else "model."
    w = _Writer(generator)
    h = cfg.hidden_size
    w.randn(text + "embed_tokens.weight", cfg.vocab_size, h, std=EMBED_STD)
    for i, kind in enumerate(cfg.layer_types):
        w.layer(f"{text}layers.{i}.", cfg, kind == LINEAR, cfg.is_sparse(i), grouped, stacked_experts)
    w.randn(text + "norm.weight", h, std=NORM_JITTER)
    if not cfg.tie_word_embeddings:
        w.randn("lm_head.weight", cfg.vocab_size, h, std=LM_HEAD_STD)
    _mtp(w, cfg, grouped, stacked_experts)
    if nested:
        w.vision("model.visual.", config["vision_config"])
    return w.tensors
