"""Full-size models with random weights, shaped like released Qwen checkpoints, in device memory.

``random:SHAPE`` names one. transformers' model for the shape's config is made on the
device a block at a time with its own seeded initialisation (:mod:`.blockwise_init`), and
our engine loads those tensors through its ordinary checkpoint loader (the tensor names
and layouts a saved checkpoint has), each block freed once it is copied. Both engines
thus run the same weights and nothing is written but ``config.json`` and the tiny tokenizer (the engine
reads both from a directory): a 35B-A3B in bf16 is about 67 GB, more than the GPU
machine's disk holds beside anything else. The transformers baseline is built again
from the same config and seed after our engine is gone, so the two never share memory.

``random:SHAPE@QUANT`` (``random:qwen3.6-27b@fp8-block``) quantizes those random weights
on the device with the ``ninfer-make-tiny --quant QUANT`` writer and hands the loader that
format's published tensors and config keys, so quantized kernels are measured at real
shapes without a download; the transformers baseline stays the dense model.

Benchmarks feed token ids, so the tiny tokenizer only means the vocabulary rows past its
512 tokens are never prompted. ``ninfer-serve random:SHAPE`` serves one too (to measure
the server path at a real shape): the output is noise, and tokens past the tokenizer's
512 decode to nothing, so measure it by token counts (usage), not by text.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterator

import torch

from ninfer.engine.spec.shortlist import FILE as SHORTLIST_FILE, build_shortlist, write_shortlist
from ninfer.model import blockwise_init
from ninfer.model.sources import RANDOM_PREFIX
from ninfer.tiny.tokenizer_files import write_tokenizer_files

PREFIX = RANDOM_PREFIX

_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "use_sliding_window": False,
}
#: the text decoder of Qwen3.6 (Qwen3.5 architecture): 3 Gated DeltaNet layers to 1 gated attention
_QWEN3_6 = {
    "vocab_size": 248320, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
}

#: Hugging Face configs (text decoders), from the released checkpoints' config.json
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                      "num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": []},
    "qwen3.6-27b": {**_QWEN3_6, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48},
    "qwen3.6-35b-a3b": {**_QWEN3_6, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "linear_num_value_heads": 32, "num_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512},
    # ``ninfer-train --preset gpu-deep``'s model (its vocabulary as the trained tokenizer pads
    # it): a speculative round's cost at that depth without training one first
    "train-gpu-deep": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 8256,
                       "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 32,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                       "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                       "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
                       "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "attention_bias": False,
                       "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "full_attention_interval": 4,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                           "partial_rotary_factor": 0.25}},
}


def shape_of(model: str) -> str | None:
    """The shape a ``random:SHAPE[@QUANT]`` reference names (None for anything else)."""
    if not model.startswith(PREFIX):
        return None
    shape = model[len(PREFIX):].partition("@")[0]
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r} (known: {', '.join(SHAPES)})")
    return shape


def quant_of(model: str) -> str | None:
    """The weight layout a ``random:SHAPE@QUANT`` reference asks for (None: dense)."""
    return model.partition("@")[2] or None if model.startswith(PREFIX) else None


def _hf_config(shape: str):
    from transformers import AutoConfig

    fields = {k: v for k, v in SHAPES[shape].items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model(SHAPES[shape]["model_type"], **fields)


def config_dir(shape: str, root: Path, quant=None) -> Path:
    """``root/SHAPE``: the shape's ``config.json``, the tiny tokenizer and an LM-head
    shortlist, written once; with ``quant`` (``(NAME, the writer's TinyQuant)``),
    ``root/SHAPE@NAME`` with the format's config keys and files."""
    out = Path(root) / (shape if quant is None else f"{shape}@{quant[0]}")
    if (out / "config.json").exists() and (out / SHORTLIST_FILE).exists():  # (older caches lack the shortlist)
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out)
    config = {**SHAPES[shape], "eos_token_id": ids["eos_token_id"]}
    if quant is not None:
        config.update(quant[1].config)
        for name, content in quant[1].files.items():
            (out / name).write_text(json.dumps(content, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["generation_eos_token_ids"]}))
    # an LM-head shortlist (--lm-head-draft) in id order: random weights have no frequencies,
    # and the tiny tokenizer's ids come first, which is all a prompt here can hold
    special = [t for t in (ids.get("eos_token_id"), ids.get("pad_token_id")) if isinstance(t, int)]
    vocab = SHAPES[shape]["vocab_size"]
    write_shortlist(out, build_shortlist(torch.zeros(0, dtype=torch.int64), vocab, special, vocab))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_hf(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """transformers' model for ``shape`` on ``device``, seeded: the tensors :func:`model_source`
    streams for the same seed (docs: :mod:`ninfer.model.blockwise_init`)."""
    return blockwise_init.whole(_meta_hf(shape, dtype), torch.device(device), seed).eval()


def _meta_hf(shape: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(shape), dtype=dtype)


def model_source(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0, extras=None,
                 registry=None):
    """What ``LLM`` needs for ``model``: ``(path, weights)``. For ``random:SHAPE`` the path
    holds only the config and tokenizer and ``weights`` streams a freshly built random
    model, then what ``extras(config, generator)`` adds (the family's ``random_extras``:
    tensors transformers does not build, such as the MTP head); with ``@QUANT`` they are
    quantized first (``registry`` supplies the writer). Anything else is passed through
    with ``weights`` None."""
    shape = shape_of(model)
    if shape is None:
        return model, None
    from ninfer.tiny.cache import cache_root

    root = cache_root().parent / "random"
    quant = quant_of(model)
    weights = blockwise_init.stream(_meta_hf(shape, dtype), torch.device(device), seed)
    if extras is not None:
        weights = itertools.chain(weights, _extra_weights(extras, SHAPES[shape], dtype, seed))
    if quant is None:
        return str(config_dir(shape, root)), weights
    quantized = _quantize(quant, SHAPES[shape], weights, registry)
    return str(config_dir(shape, root, (quant, quantized))), _drain(quantized.tensors)


def _quantize(quant: str, config: dict, weights, registry):
    """Every tensor in ``quant``'s published layout, on the device the weights are on. The
    writer takes one decoder layer at a time (and the tensors between layers as their own
    groups), so a layer's dense originals are freed before the next is built: the peak is
    the quantized model plus one dense layer, where the whole dense model first took the
    35B-A3B's 67 GB on top (an H200's memory; now an H100 holds it)."""
    from ninfer.plugins import load_registry
    from ninfer.model.weight_format import TinyQuant
    from ninfer.tiny.make import tiny_quant_writers

    writers = tiny_quant_writers(registry or load_registry())
    if quant not in writers:
        raise ValueError(f"random:SHAPE@{quant}: no weight format writes {quant!r} "
                         f"(available: {', '.join(sorted(writers))})")
    tensors, meta = {}, {"config": {}, "files": {}}
    for _, group in itertools.groupby(weights, key=_layer_of):
        part = writers[quant](config, dict(group))
        tensors.update(part.tensors)
        meta = _merged(meta, {"config": part.config, "files": part.files}, f"random:SHAPE@{quant}")
    return TinyQuant(tensors, meta["config"], meta["files"])


def _layer_of(item: tuple[str, torch.Tensor]) -> str:
    """The decoder layer a tensor belongs to (``model.layers.3.``, ``mtp.layers.0.``), or
    "" for the tensors between layers (embeddings, final norm, head)."""
    name = item[0]
    at = name.find(".layers.")
    if at < 0:
        return ""
    number = name[at + len(".layers."):].partition(".")[0]
    return name[:at + len(".layers.")] + number if number.isdigit() else ""


def _merged(a, b, where: str):
    """Two layers' format metadata as one: dicts merged by key, lists joined (the dense
    modules each layer keeps), anything else must agree (a format's block or group size)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {key: _merged(a[key], b[key], f"{where}: {key}") if key in a and key in b else a.get(key, b.get(key))
                for key in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):
        return a + [item for item in b if item not in a]
    if a != b:
        raise ValueError(f"{where}: the layers' quantized layouts disagree ({a!r} against {b!r})")
    return a


def _drain(tensors: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``' items, each dropped from the dict once the loader has taken it."""
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def _extra_weights(extras, config: dict, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in extras(config, generator).items():
        yield name, tensor.to(dtype)
