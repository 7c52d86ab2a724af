"""Checkpoint loading: family lookup, config layouts, strict tensor accounting."""

from __future__ import annotations

import pytest
import torch

from ninfer.model.loader import find_family, iter_weights, load_model, read_config, read_generation_config
from ninfer.plugins import UnknownCapabilityError, load_registry
from ninfer_plugins.models.config import DecoderConfig, rope_settings


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_family_is_found_by_architecture_then_model_type(registry):
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3"}
    assert find_family(registry, moe).name == "qwen3_moe"
    assert find_family(registry, {"architectures": ["SomethingElse"], "model_type": "qwen3"}).name == "qwen3"
    with pytest.raises(UnknownCapabilityError, match="qwen3_moe"):
        find_family(registry, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_both_rope_config_layouts_agree():
    classic = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    nested = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    assert rope_settings(classic) == rope_settings(nested) == (5e5, {"rope_type": "linear", "factor": 2.0})
    assert rope_settings({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)
    assert rope_settings({"rope_theta": 1e6, "rope_scaling": None}) == (1e6, None)


def test_expert_count_is_read_under_either_name(tiny_qwen3_moe):
    config = read_config(tiny_qwen3_moe)
    renamed = {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": config["num_experts"]}
    assert DecoderConfig.from_hf(renamed).num_experts == config["num_experts"] == 8
    assert [DecoderConfig.from_hf(config).is_sparse(i) for i in range(3)] == [True, False, True]


def test_load_model_uses_checkpoint_dtype_and_reads_generation_config(tiny_qwen3, registry):
    model, config, family = load_model(tiny_qwen3, registry)
    assert family.name == "qwen3" and config["model_type"] == "qwen3"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    assert read_generation_config(tiny_qwen3)["eos_token_id"]
    assert read_generation_config(tiny_qwen3 / "missing") == {}


def test_bfloat16_load_converts_weights(tiny_qwen3, registry):
    model, _, _ = load_model(tiny_qwen3, registry, torch.bfloat16)
    weights = dict(iter_weights(tiny_qwen3))
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, weights["model.embed_tokens.weight"].to(torch.bfloat16))


def test_fused_projections_hold_the_checkpoint_slices(tiny_qwen3, registry):
    model, _, _ = load_model(tiny_qwen3, registry, torch.float32)
    weights = dict(iter_weights(tiny_qwen3))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]))


def test_tied_head_shares_the_embedding(tiny_qwen3_moe, registry):
    model, _, _ = load_model(tiny_qwen3_moe, registry, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_or_missing_tensors_are_errors(tiny_qwen3, registry):
    config = read_config(tiny_qwen3)
    family = find_family(registry, config)
    weights = dict(iter_weights(tiny_qwen3))
    model = family.build(config, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="matches no model parameter"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"leaves 1 model parameter.*qkv_proj"):
        model.load_weights((n, t) for n, t in weights.items() if n != "model.layers.2.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(3))])


def test_the_production_build_path_imports_neither_checkpoint_maker():
    """The demo/test checkpoint maker and the random-shape builder load only when a model
    reference names them (``tiny:``, ``random:``), never with the engine builder or server."""
    import subprocess
    import sys

    code = ("import sys, ninfer.engine.builder, ninfer.server.run; "
            "print(sorted(m for m in sys.modules if m.startswith('ninfer.tiny') or m.endswith('random_weights')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_random_shapes_take_a_quantized_layout(monkeypatch, tmp_path):
    """``random:SHAPE@QUANT`` quantizes the random weights with that layout's writer: the
    loader reads the format's config keys and tensors and builds quantized layers."""
    import json

    from ninfer import LLM, SamplingParams
    from ninfer.model import random_weights
    from ninfer_plugins.models.quant_linear import QuantLinear

    small = {**random_weights.SHAPES["qwen3-0.6b"], "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 1024}
    monkeypatch.setitem(random_weights.SHAPES, "small-test", small)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert random_weights.shape_of("random:small-test@awq") == "small-test"
    assert random_weights.quant_of("random:small-test@awq") == "awq"
    assert random_weights.quant_of("random:small-test") is None
    llm = LLM("random:small-test@awq", device="cpu", dtype="fp32", max_context=64, max_concurrency=1)
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    [written] = tmp_path.rglob("small-test@awq/config.json")
    config = json.loads(written.read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="no weight format writes 'int3'"):
        LLM("random:small-test@int3", device="cpu", dtype="fp32", max_context=64, max_concurrency=1)


@pytest.mark.parametrize("quant", ["fp8-block", "gptq", "ct-nvfp4", "modelopt-nvfp4"])
def test_random_shapes_are_quantized_a_layer_at_a_time_as_the_whole_model_would_be(monkeypatch, quant):
    """The random build hands the format's writer one decoder layer at a time, so a layer's
    dense tensors are freed before the next is made (the full-size 35B-A3B then fits an
    H100). The result must be what the writer makes of the whole model: the same tensors
    and the same config and files, the layers' dense module lists joined."""
    from ninfer.model import blockwise_init, random_weights
    from ninfer.tiny.make import tiny_quant_writers

    small = {**random_weights.SHAPES["qwen3.6-35b-a3b"], "hidden_size": 256, "num_hidden_layers": 4,
             "num_experts": 8, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
             "vocab_size": 1024}
    monkeypatch.setitem(random_weights.SHAPES, "small-moe", small)
    registry = load_registry()

    def stream():
        return blockwise_init.stream(random_weights._meta_hf("small-moe", torch.float32), torch.device("cpu"), 0)

    whole = tiny_quant_writers(registry)[quant](small, dict(stream()))
    layered = random_weights._quantize(quant, small, stream(), registry)

    def unordered(meta):
        if isinstance(meta, dict):
            return {key: unordered(value) for key, value in meta.items()}
        return sorted(map(str, meta)) if isinstance(meta, list) else meta

    assert whole.tensors.keys() == layered.tensors.keys()
    assert all(torch.equal(whole.tensors[name], layered.tensors[name]) for name in whole.tensors)
    assert unordered(whole.config) == unordered(layered.config)
    assert unordered(whole.files) == unordered(layered.files)
    dense = unordered(layered.config).get("quantization_config", {}).get("modules_to_not_convert")
    assert dense is None or any(".layers.3." in name for name in dense)  # every layer's list joined
