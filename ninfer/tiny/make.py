"""Writing a tiny random Hugging Face checkpoint of any registered model family.

The result loads in both ninfer and ``transformers`` (config.json, generation_config.json,
safetensors weights, tokenizer and chat template), so tests can compare the two without
downloading anything. Everything derives from the seed: the same seed and family give
byte-identical files. ``quant`` writes the checkpoint in a quantized layout instead, by
quantizing the random weights with the writer a weight-format plugin offers under that
name (:class:`ninfer.model.weight_format.WeightFormat` ``tiny_writers``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ninfer.model.loader import INDEX_FILE, SINGLE_FILE
from ninfer.plugins import PluginRegistry, load_registry
from ninfer.tiny.tokenizer_files import write_tokenizer_files

#: vocabulary rows are padded to a multiple of this, as real checkpoints pad theirs
VOCAB_MULTIPLE = 64


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _shard_names(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Split ``names`` (in order) into ``shards`` contiguous groups of similar byte size."""
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:
        # the group whose share of the bytes this tensor starts in
        groups[min(shards - 1, done * shards // total)].append(name)
        done += sizes[name]
    return groups


def write_weights(out_dir: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Save as ``model.safetensors``, or ``shards`` files plus the index that lists them."""
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata=metadata)
        return
    names = sorted(tensors)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be between 1 and {len(names)}, got {shards}")
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    weight_map = {}
    for i, group in enumerate(_shard_names(names, sizes, shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out_dir / file), metadata=metadata)
        weight_map.update(dict.fromkeys(group, file))
    _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def write_configs(out_dir: Path, config: dict[str, Any], ids: dict[str, Any]) -> None:
    """config.json, and a generation_config.json with the tokenizer's ids (``ids``: what
    :func:`write_tokenizer_files` returned) and a released Qwen3 checkpoint's sampler defaults."""
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids["pad_token_id"],
            "eos_token_id": ids["generation_eos_token_ids"],
            "pad_token_id": ids["pad_token_id"],
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
        },
    )


def tiny_quant_writers(registry: PluginRegistry) -> dict[str, Any]:
    """``--quant`` name -> writer, over every installed weight format."""
    return {name: writer for fmt in registry.all("weight_format") for name, writer in fmt.tiny_writers.items()}


def make_tiny(
    out_dir: Path,
    family: str,
    seed: int = 0,
    registry: PluginRegistry | None = None,
    shards: int = 1,
    quant: str | None = None,
) -> Path:
    """Write a tiny checkpoint of ``family`` into ``out_dir`` (created if needed); returns it.
    ``quant``: a quantized layout's tiny-writer name (``ninfer-make-tiny --quant``)."""
    registry = registry or load_registry()
    fam = registry.get("model_family", family, key="--family")
    if fam.tiny_config is None or fam.tiny_weights is None:
        raise ValueError(f"model family {family!r} has no tiny-checkpoint recipe")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out_dir)
    vocab = -(-ids["vocab_size"] // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = {
        **fam.tiny_config(),
        "vocab_size": vocab,
        # Qwen3 configs name <|endoftext|> as bos although the tokenizer never adds one
        "bos_token_id": ids["pad_token_id"],
        "eos_token_id": ids["eos_token_id"],
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = fam.tiny_weights(config, generator)
    if quant is not None:
        writers = tiny_quant_writers(registry)
        if quant not in writers:
            raise ValueError(f"--quant {quant!r}: no weight format writes it (available: {', '.join(sorted(writers))})")
        quantized = writers[quant](config, tensors)
        tensors, config = quantized.tensors, {**config, **quantized.config}
        for name, content in quantized.files.items():
            _write_json(out_dir / name, content)
    write_configs(out_dir, config, ids)
    write_weights(out_dir, {n: t.contiguous() for n, t in tensors.items()}, shards)
    return out_dir
