"""Writing the trained model as a Qwen3.5 checkpoint directory, in the released layout.

config.json is the tiny qwen3_5 maker's (:mod:`ninfer_plugins.models.qwen3_5`) with the
preset's shape, and the tensors are the tiny maker's set for that config with every text
and MTP tensor replaced by the trained one; names and shapes must match exactly, so the
layout cannot drift from what the loaders (ninfer's and transformers') are tested on. The
small vision tower the layout carries stays random: the text path never reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ninfer.tiny.make import VOCAB_MULTIPLE, write_configs, write_weights
from ninfer.train.presets import Preset
from ninfer_plugins.models.hybrid_config import FULL, LINEAR
from ninfer_plugins.models.hybrid_tiny import tiny_text_config
from ninfer_plugins.models.qwen3_5 import nested_tiny_config, tiny_weights

VISION_PREFIX = "model.visual."


def padded_vocab(size: int) -> int:
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def mrope_section(rotary_dim: int) -> list[int]:
    """Split the rotary frequencies over (t, h, w) as Qwen does (32 -> [11, 11, 10]); text
    positions are equal in all three, so only the sum matters."""
    n = rotary_dim // 2
    base, rest = divmod(n, 3)
    return [base + (rest > 0), base + (rest > 1), base]


def hf_config(preset: Preset, ids: dict[str, Any]) -> dict[str, Any]:
    text = {
        **tiny_text_config("qwen3_5_text"),
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "linear_num_key_heads": preset.linear_key_heads,
        "linear_num_value_heads": preset.linear_value_heads,
        "linear_key_head_dim": preset.linear_key_dim,
        "linear_value_head_dim": preset.linear_value_dim,
    }
    config = nested_tiny_config("Qwen3_5ForConditionalGeneration", "qwen3_5", text)
    text = config["text_config"]
    vocab = padded_vocab(ids["vocab_size"])
    text["vocab_size"] = vocab
    text["layer_types"] = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(preset.num_layers)]
    rotary = int(preset.head_dim * text["rope_parameters"]["partial_rotary_factor"])
    text["rope_parameters"]["mrope_section"] = mrope_section(rotary)
    # top-level ids as ninfer-make-tiny writes them (Qwen names <|endoftext|> as bos)
    return {**config, "vocab_size": vocab, "bos_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"]}


def checkpoint_tensors(config: dict[str, Any], trained: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The released tensor set for ``config``: ``trained`` plus the (random) vision tower."""
    layout = tiny_weights(config, torch.Generator().manual_seed(seed))
    text_names = {n for n in layout if not n.startswith(VISION_PREFIX)}
    if text_names != set(trained):
        raise RuntimeError(
            f"trained tensors differ from the qwen3_5 layout: missing {sorted(text_names - set(trained))[:5]}, "
            f"extra {sorted(set(trained) - text_names)[:5]}"
        )
    for name in text_names:
        if layout[name].shape != trained[name].shape:
            raise RuntimeError(f"{name}: trained shape {tuple(trained[name].shape)}, layout {tuple(layout[name].shape)}")
        layout[name] = trained[name].detach().to("cpu", torch.float32).contiguous()
    return layout


def write_checkpoint(out_dir: Path, config: dict[str, Any], ids: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json, generation_config.json and the weights; the tokenizer files are written beside."""
    write_configs(out_dir, config, ids)
    write_weights(out_dir, tensors)
