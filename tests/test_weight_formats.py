"""Quantized checkpoints (#22): every published layout loads and runs through its reference path.

For each tiny family (dense, MoE, hybrid, hybrid MoE) and each ``ninfer-make-tiny --quant``
layout: the checkpoint's layers convert back to the weights they were quantized from
(within the format's rounding), and our quantized forward equals the same model loaded
densely with the dequantized weights. Where transformers reads the format on CPU, its
logits are the oracle too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from _tiny import varlen_batch
from ninfer.model.loader import iter_weights, load_model, read_config
from ninfer.model.weight_format import find_scheme
from ninfer.plugins import load_registry
from ninfer.tiny.make import make_tiny
from ninfer_kernels import quant_rows
from ninfer_kernels.quant_formats import Int4Group
from ninfer_plugins.models.quant_linear import QuantLinear
from ninfer_plugins.weights.tiny_targets import per_expert

FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
QUANTS = ["fp8-block", "ct-fp8", "ct-w4a16", "ct-nvfp4", "modelopt-nvfp4", "awq", "gptq"]
#: relative (Frobenius) error of a layer's dequantized weight against what was quantized:
#: e4m3 keeps 3 mantissa bits, 4-bit formats 15 steps per group (of 16 to 64 inputs here)
WEIGHT_ERROR = {"fp8-block": 0.035, "ct-fp8": 0.035, "ct-w4a16": 0.15, "ct-nvfp4": 0.12, "modelopt-nvfp4": 0.12,
                "awq": 0.12, "gptq": 0.15}
BLOCK_SIZE = 16
PROMPTS = [list(range(5, 27)), [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory, registry):
    root = tmp_path_factory.mktemp("dense")
    return {f: make_tiny(root / f, f, registry=registry) for f in FAMILIES}


def quantized_dir(tmp_path_factory, registry, family: str, quant: str):
    return make_tiny(tmp_path_factory.mktemp(f"{family}-{quant}"), family, registry=registry, quant=quant)


def prefill_logits(model, registry, prompts=PROMPTS) -> torch.Tensor:
    kv = registry.get("kv_dtype", "bf16")
    tables, next_page = [], 1
    for p in prompts:
        pages = -(-len(p) // BLOCK_SIZE)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
    model.bind_kv_caches([kv.allocate(next_page, BLOCK_SIZE, s.num_kv_heads, s.head_dim, torch.float32, "cpu")
                          for s in model.attention_specs()])
    if hasattr(model, "allocate_state"):
        model.allocate_state(len(prompts), "cpu")
    ids, positions, batch = varlen_batch([(0, p) for p in prompts], tables, BLOCK_SIZE)
    batch.state_slots = torch.arange(len(prompts))
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, batch))


def converted(path, registry):
    scheme = find_scheme(registry, read_config(path), path)
    assert scheme is not None
    return scheme.convert(iter_weights(path))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_forward_matches_dequantized_reference(family, quant, registry, dense_dirs, tmp_path_factory):
    path = quantized_dir(tmp_path_factory, registry, family, quant)
    original = per_expert(dict(iter_weights(dense_dirs[family])))
    layers = 0
    for name, value in converted(path, registry):
        if quant_rows.is_quantized(value):
            layers += 1
            want = original[name]
            error = (value.dequantize() - want).norm() / want.norm()
            assert error < WEIGHT_ERROR[quant], (name, float(error))
    assert layers > 10

    model, _, _ = load_model(path, registry, torch.float32)
    assert model.weight_format.split()[0] in ("fp8", "compressed-tensors", "modelopt", "awq", "gptq")
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    if "moe" in family:
        assert all(m.experts.quantized for m in model.modules() if hasattr(m, "experts"))
    if quant in ("gptq", "ct-w4a16", "awq"):  # symmetric int4 stays marked through fusing and stacking
        int4 = [v for m in model.modules() for v in vars(m).values()
                for v in (v if isinstance(v, list) else [v]) if isinstance(v, Int4Group)]
        assert int4 and all(w.symmetric == (quant != "awq") for w in int4)
    dequantized = ((n, v.dequantize(torch.float32) if quant_rows.is_quantized(v) else v)
                   for n, v in converted(path, registry))
    reference, _, _ = load_model(dense_dirs[family], registry, torch.float32, weights=dequantized)
    ours, expected = prefill_logits(model, registry), prefill_logits(reference, registry)
    assert (ours - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


#: the packages transformers (5.x) needs to read each layout on CPU: AWQ goes through
#: gptqmodel, GPTQ through optimum and gptqmodel (its CPU kernels)
HF_NEEDS = {"fp8-block": (), "ct-w4a16": ("compressed_tensors",), "awq": ("gptqmodel", "accelerate"),
            "gptq": ("optimum", "gptqmodel")}
#: (quant, family) pairs transformers cannot be the oracle for, and why
HF_CANNOT = {
    ("ct-w4a16", "qwen3_moe"): "compressed-tensors does not reach transformers 5's fused expert modules",
    ("ct-w4a16", "qwen3_5_moe"): "compressed-tensors does not reach transformers 5's fused expert modules",
}
#: layouts whose schemes also quantize activations, which transformers simulates and the CPU
#: reference path does not (it multiplies in the activation dtype): transformers reads a copy
#: whose config drops the activation scheme, the weights as they are
ACTIVATIONS_DROPPED = {"ct-fp8"}
NVFP4_CANNOT = "transformers (compressed-tensors 0.20) decompresses NVFP4 weights to bfloat16 inside a float32 " \
               "model, and its forward fails on the mixed dtypes (with or without the activation scheme)"


def without_activation_scheme(path: Path) -> Path:
    """``path``'s compressed-tensors checkpoint with no ``input_activations`` in its config."""
    config = json.loads((path / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("quant", [*HF_NEEDS, "ct-fp8", "ct-nvfp4", "modelopt-nvfp4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_logits_match_transformers(family, quant, registry, tmp_path_factory):
    if quant == "modelopt-nvfp4":
        pytest.skip("transformers has no reader for ModelOpt NVFP4 checkpoints (it only quantizes on Blackwell GPUs)")
    if quant == "ct-nvfp4":
        pytest.skip(NVFP4_CANNOT)
    missing = [name for name in HF_NEEDS.get(quant, ("compressed_tensors",)) if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"transformers reads {quant} only with {', '.join(missing)} installed, not here")
    if (quant, family) in HF_CANNOT:
        pytest.skip(HF_CANNOT[quant, family])
    from transformers import AutoModelForCausalLM

    path = quantized_dir(tmp_path_factory, registry, family, quant)
    if quant in ACTIVATIONS_DROPPED:
        path = without_activation_scheme(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, _, _ = load_model(path, registry, torch.float32)
    ours = prefill_logits(model, registry, PROMPTS[:1])
    with torch.no_grad():
        expected = hf(torch.tensor(PROMPTS[:1])).logits[0].float()
    assert (ours - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
