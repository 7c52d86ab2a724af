"""Weight-format conventions and refusals, checked against hand-built tensors (#22).

Each format's packing is pinned by a vector worked out from its documented convention,
not by our own writer, so a writer and reader sharing one mistake cannot pass; refusals
must be typed and name the tensor at fault.
"""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.model.loader import load_model
from ninfer.model.weight_format import WeightFormatError, describe, find_scheme
from ninfer.plugins import load_registry
from ninfer.tiny.make import make_tiny, write_weights
from ninfer_kernels import moe, quant_rows
from ninfer_plugins.models.quant_linear import QuantLinear, join_shards
from ninfer_plugins.weights import awq, compressed_tensors, gptq, modelopt, qwen_fp8
from ninfer_plugins.weights.packing import AWQ_ORDER, pack_int4
from ninfer_plugins.weights.quantize import fp8_block, int4_group, nvfp4


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _one(scheme, tensors: dict) -> object:
    [(name, value)] = [(n, v) for n, v in scheme.convert(tensors.items()) if quant_rows.is_quantized(v)]
    assert name == "layer.weight"
    return value


def _i32(word: int) -> int:
    """A 32-bit pattern as the int32 a checkpoint stores."""
    return word - 2**32 if word >= 2**31 else word


def test_awq_interleaved_columns_and_zero_points():
    # column c of the eight in each word holds code c + 1; AWQ stores column AWQ_ORDER[i] at bits 4i
    word = _i32(sum((AWQ_ORDER[i] + 1) << (4 * i) for i in range(8)))
    k, group = 8, 8
    tensors = {"layer.qweight": torch.full((k, 1), word, dtype=torch.int32),
               "layer.qzeros": torch.tensor([[sum(1 << (4 * i) for i in range(8))]], dtype=torch.int32),
               "layer.scales": torch.full((1, 8), 0.5)}
    weight = _one(awq.AwqScheme({"group_size": group}), tensors)
    expected = (torch.arange(1, 9, dtype=torch.float32) - 1) * 0.5  # (code - zero 1) * scale, per column
    assert torch.equal(weight.dequantize(), expected[:, None].expand(8, k))


def test_gptq_packs_rows_and_stores_zero_minus_one():
    # eight input rows per word, row j at bits 4j; qzeros 7 means zero 8 in the v1 layout
    word = sum(j << (4 * j) for j in range(8))
    tensors = {"layer.qweight": torch.full((1, 8), word, dtype=torch.int32),
               "layer.qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
               "layer.scales": torch.full((1, 8), 2.0), "layer.g_idx": torch.zeros(8, dtype=torch.int32)}
    v1 = _one(gptq.GptqScheme({"group_size": 8}), dict(tensors)).dequantize()
    assert torch.equal(v1, ((torch.arange(8.0) - 8) * 2)[None, :].expand(8, 8))
    v2 = _one(gptq.GptqScheme({"group_size": 8, "checkpoint_format": "gptq_v2"}), dict(tensors)).dequantize()
    assert torch.equal(v2, v1 + 2)


def test_gptq_act_order_with_a_permuted_g_idx_is_refused():
    scheme = gptq.GptqScheme({"group_size": 8, "desc_act": True})
    tensors = {"layer.qweight": torch.zeros(2, 8, dtype=torch.int32), "layer.qzeros": torch.zeros(2, 1, dtype=torch.int32),
               "layer.scales": torch.ones(2, 8), "layer.g_idx": torch.tensor([1] * 8 + [0] * 8, dtype=torch.int32)}
    with pytest.raises(WeightFormatError, match="g_idx") as err:
        list(scheme.convert(tensors.items()))
    assert err.value.tensor == "layer.g_idx"


def test_compressed_tensors_int4_is_offset_by_eight_and_nvfp4_divides_by_the_global_scale():
    int4 = compressed_tensors.CompressedTensorsScheme(
        {"config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized",
                                 "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 8}}}})
    codes = torch.arange(8)  # stored codes 0..15 are signed values -8..7
    weight = _one(int4, {"layer.weight_packed": pack_int4(codes[None]), "layer.weight_scale": torch.ones(1, 1),
                         "layer.weight_shape": torch.tensor([1, 8])})
    assert torch.equal(weight.dequantize(), (codes - 8.0)[None])
    fp4 = compressed_tensors.CompressedTensorsScheme(
        {"config_groups": {"g": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                 "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}})
    packed = torch.tensor([[0x21] + [0] * 7], dtype=torch.uint8)  # low nibble 1 (0.5) is column 0, high 2 (1.0) column 1
    weight = _one(fp4, {"layer.weight_packed": packed, "layer.weight_scale": torch.full((1, 1), 2.0).to(torch.float8_e4m3fn),
                        "layer.weight_global_scale": torch.tensor([4.0])})
    assert weight.dequantize()[0, :3].tolist() == [0.25, 0.5, 0.0]  # e2m1 * 2 / 4


def test_overlapping_compressed_tensors_groups_give_a_layer_its_most_specific_target():
    """As compressed-tensors ranks a layer's matches: an exact name, then a regular
    expression, then the ``Linear`` class, whatever order the groups come in."""
    int4 = {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 8}}
    fp4 = {"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "group_size": 16}}
    fp8 = {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    scheme = compressed_tensors.CompressedTensorsScheme({"config_groups": {
        "group_0": {"targets": ["Linear"], **int4},
        "group_1": {"targets": [r"re:.*mlp\.experts.*"], **fp4},
        "group_2": {"targets": ["model.layers.0.mlp.experts.3.up_proj", r"re:.*self_attn\.o_proj$"], **fp8},
    }})
    kind = {name: scheme.group_of(name).name for name in (
        "model.layers.0.mlp.experts.3.up_proj", "model.layers.0.mlp.experts.4.up_proj",
        "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj")}
    assert kind == {"model.layers.0.mlp.experts.3.up_proj": "group_2", "model.layers.0.mlp.experts.4.up_proj": "group_1",
                    "model.layers.0.self_attn.o_proj": "group_2", "model.layers.0.self_attn.q_proj": "group_0"}
    packed = torch.tensor([[0x21] + [0] * 7], dtype=torch.uint8)  # an NVFP4 expert loads as NVFP4, not W4A16
    layer = "model.layers.0.mlp.experts.4.up_proj"
    tensors = {f"{layer}.weight_packed": packed, f"{layer}.weight_scale": torch.ones(1, 1).to(torch.float8_e4m3fn),
               f"{layer}.weight_global_scale": torch.tensor([1.0])}
    [(name, weight)] = [(n, v) for n, v in scheme.convert(tensors.items()) if quant_rows.is_quantized(v)]
    assert name == f"{layer}.weight" and weight.dequantize()[0, :2].tolist() == [0.5, 1.0]


def test_modelopt_weight_scale_2_is_alpha_and_qwen_fp8_scale_inv_multiplies(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    scheme = modelopt.claim({}, tmp_path)
    weight = _one(scheme, {"layer.weight": torch.tensor([[0x0F] + [0] * 7], dtype=torch.uint8),
                           "layer.weight_scale": torch.ones(1, 1).to(torch.float8_e4m3fn),
                           "layer.weight_scale_2": torch.tensor(3.0), "layer.input_scale": torch.tensor(1.0)})
    assert weight.dequantize()[0, 0] == -18.0  # code 15 is -6
    fp8 = qwen_fp8.QwenFp8Scheme({"quant_method": "fp8", "weight_block_size": [128, 128]})
    weight = _one(fp8, {"layer.weight": torch.full((2, 4), 2.0).to(torch.float8_e4m3fn),
                        "layer.weight_scale_inv": torch.tensor([[0.25]])})
    assert torch.equal(weight.dequantize(), torch.full((2, 4), 0.5))


def test_a_missing_scale_or_a_wrong_scale_grid_names_the_tensor():
    fp8 = qwen_fp8.QwenFp8Scheme({"quant_method": "fp8", "weight_block_size": [128, 128]})
    weight = torch.zeros(256, 128).to(torch.float8_e4m3fn)
    with pytest.raises(WeightFormatError) as err:
        list(fp8.convert([("model.layers.0.mlp.up_proj.weight", weight)]))
    assert err.value.tensor == "model.layers.0.mlp.up_proj.weight_scale_inv" and "missing" in str(err.value)
    with pytest.raises(WeightFormatError, match="128x128 blocks") as err:
        list(fp8.convert([("p.weight", weight), ("p.weight_scale_inv", torch.ones(1, 1))]))
    assert err.value.tensor == "p.weight_scale_inv"


def test_unknown_or_unsupported_formats_are_refused_at_claim(registry, tmp_path):
    with pytest.raises(WeightFormatError, match="bitsandbytes.*no installed weight_format plugin"):
        find_scheme(registry, {"quantization_config": {"quant_method": "bitsandbytes"}}, tmp_path)
    with pytest.raises(WeightFormatError, match="version 'gemv'"):
        find_scheme(registry, {"quantization_config": {"quant_method": "awq", "version": "gemv"}}, tmp_path)
    with pytest.raises(WeightFormatError, match="INT4_AWQ"):
        find_scheme(registry, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}}, tmp_path)
    with pytest.raises(WeightFormatError, match="8-bit int"):
        find_scheme(registry, {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"format": "int-quantized", "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}}}},
            tmp_path)


def test_fused_shards_join_where_the_layout_allows_and_stay_apart_where_not():
    w = torch.randn(96, 64)
    parts = [fp8_block(w[:64], (32, 32)), fp8_block(w[64:], (32, 32))]
    assert len(join_shards([(slice(0, 64), parts[0], "q"), (slice(64, 96), parts[1], "k")], 96, "qkv")) == 1
    cut = [fp8_block(w[:48], (32, 32)), fp8_block(w[48:], (32, 32))]  # 48 rows: the block is cut
    segments = join_shards([(slice(0, 48), cut[0], "q"), (slice(48, 96), cut[1], "k")], 96, "qkv")
    layer = QuantLinear(64, 96, segments, None)
    x = torch.randn(3, 64)
    assert len(layer.segments) == 2
    expected = x @ torch.cat([cut[0].dequantize(), cut[1].dequantize()]).T
    assert torch.allclose(layer(x), expected, atol=1e-5)
    # NVFP4 shards with different alphas: exact segments for a linear layer, one rescaled weight on request
    a, b = nvfp4(w[:32]), nvfp4(w[32:64] * 4)
    assert len(join_shards([(slice(0, 32), a, "gate"), (slice(32, 64), b, "up")], 64, "gate_up")) == 2
    [joined] = join_shards([(slice(0, 32), a, "gate"), (slice(32, 64), b, "up")], 64, "gate_up", rescale=True)
    reference = torch.cat([a.dequantize(), b.dequantize()])
    assert ((joined.dequantize() - reference).norm() / reference.norm()) < 0.05


def test_fused_moe_takes_stacked_quantized_experts():
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 32, 16, generator=gen), torch.randn(4, 16, 16, generator=gen)
    for quantize in (lambda t: fp8_block(t, (16, 16)), lambda t: int4_group(t, 16, symmetric=False), nvfp4):
        q13 = quant_rows.stack_experts([quantize(e) for e in w13])
        q2 = quant_rows.stack_experts([quantize(e) for e in w2])
        x = torch.randn(5, 16, generator=gen)
        weights, ids = moe.moe_route(torch.randn(5, 4, generator=gen), 2, True)
        ours = moe.fused_moe(x, q13, q2, weights, ids)
        assert torch.allclose(ours, moe.fused_moe(x, q13.dequantize(), q2.dequantize(), weights, ids), atol=1e-5)


def test_unaligned_fp8_experts_are_refused_naming_the_expert(registry, tmp_path):
    path = make_tiny(tmp_path, "qwen3_moe", registry=registry, quant="fp8-block")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]  # expert intermediate size is 32
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
        n, k = tensors[name.removesuffix("_scale_inv")].shape
        q = fp8_block(torch.randn(n, k), (128, 128))
        tensors[name.removesuffix("_scale_inv")], tensors[name] = q.weight, q.scale
    write_weights(path, tensors)
    with pytest.raises(WeightFormatError, match="mid-block") as err:
        load_model(path, registry, torch.float32)
    assert "experts.gate_up_proj[" in err.value.tensor


def test_lora_on_a_quantized_layer_is_refused(registry, tmp_path):
    from ninfer.lora.adapter import LoraAdapter, LoraModule
    from ninfer.lora.config import LoraAdapterError
    from ninfer.lora.registry import LoraRegistry

    model, _, _ = load_model(make_tiny(tmp_path, "qwen3", registry=registry, quant="awq"), registry, torch.float32)
    module = LoraModule("model.layers.0.self_attn.q_proj", torch.zeros(2, 64), torch.zeros(64, 2), 1.0)
    adapter = LoraAdapter("a", tmp_path, None, (module,))
    with pytest.raises(LoraAdapterError, match="quantized in this checkpoint"):
        LoraRegistry(model).add(adapter)


def test_the_startup_summary_names_the_checkpoints_format(registry, tmp_path):
    path = make_tiny(tmp_path, "qwen3", registry=registry, quant="modelopt-nvfp4")
    assert describe(registry, path) == "modelopt nvfp4"
    assert describe(registry, tmp_path / "absent").startswith("not known")
    dense = make_tiny(tmp_path / "dense", "qwen3", registry=registry)
    assert describe(registry, dense) == "unquantized (float32)"


def test_check_reports_the_weight_format_and_refuses_an_unreadable_one(registry, tmp_path, capsys):
    from ninfer.cli.serve import main

    path = make_tiny(tmp_path / "q", "qwen3", registry=registry, quant="fp8-block")
    assert main([str(path), "--check"]) == 0
    assert capsys.readouterr().out.startswith("# weights: fp8 e4m3, 32x32 blocks (Qwen fp8)\n")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq"}
    (path / "config.json").write_text(json.dumps(config))
    assert main([str(path), "--check"]) == 2
    assert "quant_method 'hqq'" in capsys.readouterr().err


def test_make_tiny_cli_writes_the_published_layout(tmp_path, capsys):
    from ninfer.cli.make_tiny import main
    from safetensors import safe_open

    main([str(tmp_path), "--family", "qwen3_5_moe", "--quant", "gptq"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.language_model.layers.0.mlp.experts.7.down_proj.qweight").dtype == torch.int32
    assert "model.language_model.layers.0.linear_attn.in_proj_b.weight" in names  # kept dense, as released
    assert not any(n.endswith("experts.gate_up_proj") for n in names)  # quantized experts: one tensor each


def test_rows_reorder_inside_each_layout_or_refuse():
    """Qwen3-Next's grouped projections are regrouped at load: every layout reorders its rows
    (FP8 blocks only in whole, aligned blocks), and the result dequantizes to the reordered rows."""
    from ninfer_kernels.quant_rows import take_rows
    from ninfer_plugins.weights.quantize import fp8_block, int4_group, nvfp4

    w = torch.randn(8, 32)
    swap = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    for q in (fp8_block(w, (4, 16)), fp8_block(w, (1, 32)), int4_group(w, 16, symmetric=False), nvfp4(w)):
        moved = take_rows(q, swap)
        assert torch.equal(moved.dequantize(), q.dequantize()[swap]), type(q).__name__
    assert take_rows(fp8_block(w, (4, 16)), torch.tensor([2, 3, 0, 1, 4, 5, 6, 7])) is None  # splits a block


@pytest.mark.parametrize("layout", ["fp8", "int4", "nvfp4"])
def test_a_quantized_shared_expert_runs_inside_the_expert_kernel(layout):
    """A shared expert as wide as the routed ones, quantized like them, is handed to the fused
    expert op as the extra expert; the block's output equals the same block with every weight
    dequantized and the shared expert run on its own."""
    from ninfer_kernels.quant_rows import stack_experts
    from ninfer_plugins.models.quant_linear import QuantLinear
    from ninfer_plugins.models.shared_moe import SharedExpertMoE
    from ninfer_plugins.weights.quantize import fp8_block, int4_group, nvfp4

    quantize = {"fp8": lambda w: fp8_block(w, (32, 32)), "int4": lambda w: int4_group(w, 32, symmetric=False),
                "nvfp4": nvfp4}[layout]
    torch.manual_seed(0)
    h, e, i = 64, 4, 64

    def block():
        b = SharedExpertMoE(h, e, 2, i, True, i)
        for p in b.parameters():
            p.data.normal_(0, 0.1)
        return b

    ours, dense = block(), block()
    dense.load_state_dict(ours.state_dict())
    for proj in ("gate_up_proj", "down_proj"):
        stacked = getattr(ours.experts, proj).data
        q = stack_experts([quantize(stacked[j]) for j in range(e)])
        ours.experts.set_quantized(proj, q)
        getattr(dense.experts, proj).data = q.dequantize(torch.float32)
        layer = getattr(ours.shared_expert, proj)
        qs = quantize(layer.weight.data)
        setattr(ours.shared_expert, proj, QuantLinear(layer.weight.shape[1], layer.weight.shape[0], [qs], None))
        getattr(dense.shared_expert, proj).weight.data = qs.dequantize(torch.float32)
    assert ours._shared_in_kernel() is not None and dense._shared_in_kernel() is not None
    x = torch.randn(5, h)
    separate = torch.sigmoid(dense.shared_expert_gate(x)) * dense.shared_expert(x) + dense.routed(x)
    rows = ours(x).rows  # the pairs' rows, left for the next norm to sum
    assert torch.allclose(rows.float().sum(dim=1), separate, atol=1e-4, rtol=1e-4)
