"""NVIDIA ModelOpt checkpoints (``hf_quant_config.json``, or ``quant_method: modelopt``).

``hf_quant_config.json``: ``{"producer": {"name": "modelopt"}, "quantization": {"quant_algo":
"NVFP4", "group_size": 16, "exclude_modules": [...], "kv_cache_quant_algo": ...}}``; newer
exports repeat it in config.json's ``quantization_config`` (``ignore`` for the exclusions).

* NVFP4 (and its weight-only W4A16_NVFP4): ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes a
  byte, the even column low), ``weight_scale`` e4m3 ``[N, K/16]``, ``weight_scale_2`` fp32
  (the per-tensor factor: alpha), ``input_scale`` (activations; not used) -> :class:`Nvfp4`.
* FP8: ``weight`` float8_e4m3fn with a per-tensor fp32 ``weight_scale`` -> :class:`Fp8Block`
  per channel (so q/k/v shards with different scales still join into one weight).
* MIXED_PRECISION: ``quantized_layers`` names one of those per layer; each layer's tensors
  say which (a uint8 weight is NVFP4, an FP8 one FP8).

Other algorithms (INT4_AWQ, W4A8, NVFP4_AWQ with ``pre_quant_scale``, ...) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.weight_format import TinyQuant, WeightFormat, WeightFormatError
from ninfer_kernels.quant_formats import Fp8Block, Nvfp4
from ninfer_plugins.weights.collect import (
    ACTIVATION_SCALE, KV_SCALES, LayerParts, LayerScheme, divides, expect_dtype, expect_matrix, expect_shape,
)
from ninfer_plugins.weights.tiny_targets import dense_module_names, nvfp4_layers, per_expert

HF_QUANT_CONFIG = "hf_quant_config.json"
READ_ALGOS = {"NVFP4", "W4A16_NVFP4", "FP8"}
MODELOPT_VERSION = "0.37.0"


def _settings(config: dict, model_dir: Path) -> dict | None:
    """The quantization settings, from hf_quant_config.json or config.json; None if not ModelOpt's."""
    path = model_dir / HF_QUANT_CONFIG
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WeightFormatError(f"not valid JSON ({e})", HF_QUANT_CONFIG) from None
        if (data.get("producer") or {}).get("name", "modelopt") == "modelopt" and "quantization" in data:
            return {**data["quantization"], "_source": HF_QUANT_CONFIG}
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "modelopt":
        return {**quant, "exclude_modules": quant.get("ignore", quant.get("exclude_modules", [])),
                "_source": "config.json quantization_config"}
    return None


class ModelOptScheme(LayerScheme):
    def __init__(self, settings: dict):
        algo = str(settings.get("quant_algo", "")).upper()
        where = settings["_source"]
        algos = {algo}
        if algo == "MIXED_PRECISION":
            algos = {str(v.get("quant_algo", "")).upper() for v in (settings.get("quantized_layers") or {}).values()}
        unread = sorted(algos - READ_ALGOS)
        if unread:
            raise WeightFormatError(f"quant_algo {', '.join(unread)}: ninfer reads ModelOpt's {', '.join(sorted(READ_ALGOS))}",
                                    where)
        if settings.get("group_size", 16) not in (16, None):
            raise WeightFormatError(f"group_size {settings['group_size']}: NVFP4 scales groups of 16", where)
        self.name = f"modelopt {algo.lower()}" + (f" ({', '.join(sorted(a.lower() for a in algos))})"
                                                   if algo == "MIXED_PRECISION" else "")
        self.parts = LayerParts(
            format="modelopt", parts=frozenset({"weight_scale", "weight_scale_2"}), required=_required, build=_build,
            dropped={"input_scale": ACTIVATION_SCALE, **KV_SCALES})


def _is_nvfp4(seen: dict) -> bool:
    weight, scale = seen.get("weight"), seen.get("weight_scale")
    return ("weight_scale_2" in seen or (weight is not None and weight.dtype == torch.uint8)
            or (scale is not None and scale.dtype == torch.float8_e4m3fn))


def _required(prefix: str, seen: dict) -> set[str]:
    return {"weight", "weight_scale", "weight_scale_2"} if _is_nvfp4(seen) else {"weight", "weight_scale"}


def _build(prefix: str, parts: dict[str, torch.Tensor]) -> Any:
    weight, scale = parts["weight"], parts["weight_scale"]
    if not _is_nvfp4(parts):
        expect_dtype(weight, (torch.float8_e4m3fn,), f"{prefix}.weight")
        if scale.numel() != 1:
            raise WeightFormatError(f"an FP8 per-tensor scale has {scale.numel()} values", f"{prefix}.weight_scale")
        n, k = expect_matrix(weight, f"{prefix}.weight")
        return Fp8Block(weight, scale.float().reshape(1, 1).expand(n, 1).contiguous(), (1, k))
    expect_dtype(weight, (torch.uint8,), f"{prefix}.weight")
    expect_dtype(scale, (torch.float8_e4m3fn,), f"{prefix}.weight_scale")
    n, half = weight.shape
    divides(16, 2 * half, f"{prefix}.weight", "the input size")
    expect_shape(scale, (n, 2 * half // 16), f"{prefix}.weight_scale", "the block scales")
    alpha = parts["weight_scale_2"]
    if alpha.numel() != 1:
        raise WeightFormatError(f"has {alpha.numel()} values, expected one", f"{prefix}.weight_scale_2")
    return Nvfp4(weight, scale, alpha.float().reshape(()))


def claim(config: dict, model_dir: Path) -> ModelOptScheme | None:
    settings = _settings(config, Path(model_dir))
    return ModelOptScheme(settings) if settings is not None else None


def write_nvfp4(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    """NVFP4 as ModelOpt exports it; fused siblings share ``weight_scale_2`` as its exporter ties them."""
    def spell(module: str, q) -> dict[str, torch.Tensor]:
        return {f"{module}.weight": q.packed, f"{module}.weight_scale": q.scale,
                f"{module}.weight_scale_2": q.alpha.reshape(()),
                f"{module}.input_scale": torch.tensor(1.0)}  # a calibrated export's; unused here

    out, modules = nvfp4_layers(tensors, spell)
    exclude = dense_module_names(per_expert(tensors), modules)
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    legacy = {"producer": producer, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                                     "group_size": 16, "exclude_modules": exclude}}
    quant = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
             "ignore": exclude, "producer": producer}
    return TinyQuant(out, {"quantization_config": quant}, {HF_QUANT_CONFIG: legacy})


FORMAT = WeightFormat(
    name="modelopt",
    claim=claim,
    tiny_writers={"modelopt-nvfp4": write_nvfp4},
    description="NVIDIA ModelOpt checkpoints: NVFP4, weight-only NVFP4, FP8 per tensor, and mixes of them",
)


@hookimpl
def register_weight_formats(register) -> None:
    register(FORMAT)
