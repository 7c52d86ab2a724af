"""Tiny compressed-tensors checkpoints, as llm-compressor saves its FP8_DYNAMIC, W4A16 and NVFP4 schemes."""

from __future__ import annotations

import torch

from ninfer.model.weight_format import TinyQuant
from ninfer_plugins.weights.quantize import fp8_block
from ninfer_plugins.weights.tiny_targets import int4_layers, nvfp4_layers, per_expert, quantized_modules

CT_VERSION = "0.12.2"
#: the layers llm-compressor recipes for Qwen leave dense, as patterns (they match whatever
#: prefix the model class gives the decoder: ``model.`` or ``model.language_model.``)
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*linear_attn\.in_proj_[ab]$",
          r"re:.*linear_attn\.in_proj_ba$", r"re:.*visual.*"]


def _args(bits: int, kind: str, strategy: str, group_size: int | None = None, dynamic: bool | str = False) -> dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group_size,
            "num_bits": bits, "observer": None if dynamic else "minmax", "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": kind}


def _config(fmt: str, weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    group = {"format": fmt, "input_activations": inputs, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"quantization_config": {
        "config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None, "ignore": ignore,
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION,
    }}


def write_fp8(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    """FP8_DYNAMIC: e4m3 weights with a scale per output channel; activations per token at run time."""
    tensors = per_expert(tensors)
    modules = quantized_modules(tensors)
    out = dict(tensors)
    for module in modules:
        w = tensors[f"{module}.weight"]
        q = fp8_block(w, (1, w.shape[1]))
        out[f"{module}.weight"], out[f"{module}.weight_scale"] = q.weight, q.scale.to(w.dtype)
    return TinyQuant(out, _config("float-quantized", _args(8, "float", "channel"),
                                  _args(8, "float", "token", dynamic=True), IGNORE))


def write_w4a16(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    """W4A16: symmetric int4 per group, packed eight to an int32 along the input dimension."""
    def spell(module: str, w: torch.Tensor, q) -> dict[str, torch.Tensor]:
        return {f"{module}.weight_packed": q.qweight,  # codes are the signed value + 8 already
                f"{module}.weight_scale": q.scales.to(w.dtype),
                f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}

    out, modules, group = int4_layers(tensors, symmetric=True, spell=spell)
    return TinyQuant(out, _config("pack-quantized", _args(4, "int", "group", group), None,
                                  IGNORE))


def write_nvfp4(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    """NVFP4: e2m1 weights, e4m3 scales per 16 and a global scale shared by fused siblings."""
    def spell(module: str, q) -> dict[str, torch.Tensor]:
        return {f"{module}.weight_packed": q.packed, f"{module}.weight_scale": q.scale,
                f"{module}.weight_global_scale": (1.0 / q.alpha).reshape(1),
                f"{module}.input_global_scale": torch.ones(1)}  # what a calibrated export carries; unused here

    out, _ = nvfp4_layers(tensors, spell)
    args = {**_args(4, "float", "tensor_group", 16), "scale_dtype": "torch.float8_e4m3fn"}
    inputs = {**_args(4, "float", "tensor_group", 16, dynamic="local")}
    return TinyQuant(out, _config("nvfp4-pack-quantized", args, inputs, IGNORE))

