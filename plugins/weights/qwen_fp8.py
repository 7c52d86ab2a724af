"""Qwen's official FP8 checkpoints (``quant_method: fp8``, DeepSeek-V3's block layout).

``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

Each quantized linear layer ``P`` stores ``P.weight`` (float8_e4m3fn ``[N, K]``) and
``P.weight_scale_inv`` (fp32 ``[ceil(N/bn), ceil(K/bk)]``). Despite its name the scale
*multiplies*: the real weight is ``weight * weight_scale_inv`` of its block, which is
:class:`ninfer_kernels.quant_formats.Fp8Block` as it is. ``activation_scheme: dynamic``:
activations are quantized per token at run time by the kernels, so the checkpoint has no
activation scales; a static scheme is refused. Layers in ``modules_to_not_convert`` keep a
dense ``weight`` and load as usual.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.weight_format import TinyQuant, WeightFormat, WeightFormatError
from ninfer_kernels.quant_formats import Fp8Block
from ninfer_plugins.weights.collect import KV_SCALES, LayerParts, LayerScheme, expect_dtype, expect_shape
from ninfer_plugins.weights.quantize import fp8_block
from ninfer_plugins.weights.tiny_targets import dense_module_names, fp8_block_size, per_expert, quantized_modules



class QwenFp8Scheme(LayerScheme):
    def __init__(self, config: dict):
        self.block = tuple(config.get("weight_block_size") or ())
        if len(self.block) != 2 or min(self.block) < 1:
            raise WeightFormatError(f"weight_block_size {config.get('weight_block_size')!r} is not [rows, columns]",
                                    "config.json quantization_config")
        if config.get("fmt", "e4m3") != "e4m3":
            raise WeightFormatError(f"fmt {config['fmt']!r}: only e4m3 FP8 is read", "config.json quantization_config")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise WeightFormatError(f"activation_scheme {config['activation_scheme']!r}: only dynamic activation "
                                    "quantization is supported", "config.json quantization_config")
        bn, bk = self.block
        self.name = f"fp8 e4m3, {bn}x{bk} blocks (Qwen fp8)"
        self.parts = LayerParts(
            format="fp8", parts=frozenset({"weight_scale_inv"}),
            required=lambda prefix, seen: {"weight", "weight_scale_inv"}, build=self._build,
            dropped=KV_SCALES,
        )

    def _build(self, prefix: str, parts: dict[str, torch.Tensor]) -> Fp8Block:
        weight, scale = parts["weight"], parts["weight_scale_inv"]
        expect_dtype(weight, (torch.float8_e4m3fn,), f"{prefix}.weight")
        if weight.dim() != 2:
            raise WeightFormatError(f"a {weight.dim()}-d FP8 weight is not a linear layer ninfer reads", f"{prefix}.weight")
        bn, bk = self.block
        n, k = weight.shape
        expect_shape(scale, (-(-n // bn), -(-k // bk)), f"{prefix}.weight_scale_inv", f"the scale of {bn}x{bk} blocks")
        return Fp8Block(weight, scale.float(), (bn, bk))


def claim(config: dict, model_dir: Path) -> QwenFp8Scheme | None:
    quant = config.get("quantization_config") or {}
    return QwenFp8Scheme(quant) if quant.get("quant_method") == "fp8" else None


def write_tiny(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    tensors = per_expert(tensors)
    modules = quantized_modules(tensors)
    out = dict(tensors)
    # 128 as released where the shapes allow; tiny layers are narrower, and a smaller block
    # keeps their fused shards aligned the way 128 keeps released ones aligned
    block = (fp8_block_size(tensors, modules, config),) * 2
    for module in modules:
        q = fp8_block(tensors[f"{module}.weight"], block)
        out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = q.weight, q.scale
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block), "modules_to_not_convert": dense_module_names(tensors, modules)}
    return TinyQuant(out, {"quantization_config": quant})


FORMAT = WeightFormat(
    name="fp8",
    claim=claim,
    tiny_writers={"fp8-block": write_tiny},
    description="Qwen's FP8 checkpoints: e4m3 weights, an fp32 scale per 128x128 block",
)


@hookimpl
def register_weight_formats(register) -> None:
    register(FORMAT)
