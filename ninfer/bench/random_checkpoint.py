"""Full-size random checkpoints shaped like released Qwen3 models, for benchmarks.

Weights are transformers' own initialisation (so both engines load the same files);
the tokenizer is the tiny one (benchmarks feed token ids, and a smaller tokenizer
only means the padded vocabulary rows are never prompted).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ninfer.tiny.tokenizer_files import write_tokenizer_files

_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {**_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
}


def make_random_checkpoint(out_dir: Path, shape: str, dtype: torch.dtype, device: torch.device) -> Path:
    """Write (once) a random checkpoint of ``shape`` into ``out_dir``; returns the path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out_dir)
    config = AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "model_type"},
                                  model_type="qwen3", eos_token_id=ids["eos_token_id"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["generation_eos_token_ids"]}))
    del model
    return out_dir
