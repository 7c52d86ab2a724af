"""AWQ checkpoints (AutoAWQ's GEMM layout, ``quant_method: awq``, 4 bits, group 128).

Each quantized layer stores, with ``K`` inputs, ``N`` outputs and group ``G``:
``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]``, eight 4-bit codes per word
along the *output* dimension in the interleaved order ``0 2 4 6 1 3 5 7`` (bits ``4i`` hold
column ``AWQ_ORDER[i]`` of the eight), and ``scales`` ``[K/G, N]``. The real weight is
``(q - zero) * scale`` with unsigned codes and zeros, so converting to
:class:`Int4Group` is an unpack, a transpose to ``[N, K]`` and a repack along ``K``.
Only ``version: gemm`` with ``zero_point: true`` is read (GEMV and Marlin exports pack
differently).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.weight_format import TinyQuant, WeightFormat, WeightFormatError
from ninfer_kernels.quant_formats import Int4Group, zeros_are_eight
from ninfer_plugins.weights.collect import LayerParts, LayerScheme, divides, expect_dtype, expect_shape
from ninfer_plugins.weights.packing import AWQ_ORDER, pack_int4, unpack_int4
from ninfer_plugins.weights.tiny_targets import dense_module_names, int4_layers

WHERE = "config.json quantization_config"


class AwqScheme(LayerScheme):
    def __init__(self, quant: dict):
        bits = quant.get("bits", quant.get("w_bit", 4))
        if bits != 4:
            raise WeightFormatError(f"bits {bits}: only 4-bit AWQ is read", WHERE)
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise WeightFormatError(f"version {version!r}: only AutoAWQ's GEMM layout is read", WHERE)
        if not quant.get("zero_point", True):
            raise WeightFormatError("zero_point false: only AWQ with zero points is read", WHERE)
        self.group = int(quant.get("group_size", quant.get("q_group_size", 128)))
        self.name = f"awq int4, group {self.group}"
        self.parts = LayerParts(format="awq", parts=frozenset({"qweight", "qzeros", "scales"}),
                                required=lambda prefix, seen: {"qweight", "qzeros", "scales"}, build=self._build)

    def _build(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Group:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        expect_dtype(qweight, (torch.int32,), f"{prefix}.qweight")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        divides(self.group, k, f"{prefix}.qweight", f"the input size (group_size {self.group})")
        divides(8, k, f"{prefix}.qweight", "the input size")
        expect_shape(qzeros, (k // self.group, n // 8), f"{prefix}.qzeros", "the packed zero points")
        expect_shape(scales, (k // self.group, n), f"{prefix}.scales", "the group scales")
        codes = unpack_int4(qweight, dim=-1, order=AWQ_ORDER).t()  # [N, K]
        zeros = unpack_int4(qzeros, dim=-1, order=AWQ_ORDER).t().float()
        return Int4Group(pack_int4(codes), scales.t().contiguous(), zeros.contiguous(), self.group,
                         symmetric=zeros_are_eight(zeros))


def claim(config: dict, model_dir: Path) -> AwqScheme | None:
    quant = config.get("quantization_config") or {}
    return AwqScheme(quant) if quant.get("quant_method") == "awq" else None


def write_tiny(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    def spell(module: str, w: torch.Tensor, q) -> dict[str, torch.Tensor]:
        return {f"{module}.qweight": pack_int4(unpack_int4(q.qweight).t(), dim=-1, order=AWQ_ORDER),  # [K, N/8]
                f"{module}.qzeros": pack_int4(q.zeros.t(), dim=-1, order=AWQ_ORDER),
                f"{module}.scales": q.scales.t().contiguous().to(w.dtype)}

    out, modules, group = int4_layers(tensors, symmetric=False, spell=spell)
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": dense_module_names(out, modules)}
    return TinyQuant(out, {"quantization_config": quant})


FORMAT = WeightFormat(
    name="awq",
    claim=claim,
    tiny_writers={"awq": write_tiny},
    description="AutoAWQ GEMM checkpoints: int4 with zero points, group 128",
)


@hookimpl
def register_weight_formats(register) -> None:
    register(FORMAT)
