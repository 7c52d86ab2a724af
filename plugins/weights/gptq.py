"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: gptq``, 4 bits, group 128).

Each quantized layer stores, with ``K`` inputs, ``N`` outputs and group ``G``: ``qweight``
int32 ``[K/8, N]`` (eight *input rows* per word, row ``8i + j`` in bits ``4j``), ``qzeros``
int32 ``[K/G, N/8]`` (eight columns per word, in order), ``scales`` ``[K/G, N]`` and
``g_idx`` ``[K]`` (each input's group). The real weight is ``(q - zero) * scale``, where
the stored zero is ``zero - 1`` in the original ("v1", ``checkpoint_format: gptq``) layout
and ``zero`` itself in GPTQModel's ``gptq_v2``; a symmetric checkpoint stores 7 (v1), i.e. 8.

Activation order (``desc_act: true``) permutes which group each input belongs to. The
layouts here keep groups contiguous, so such a checkpoint loads only when every layer's
``g_idx`` is the trivial ``k // G`` (and is refused naming the layer otherwise); without
``desc_act`` the ``g_idx`` is trivial by construction and not read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.weight_format import TinyQuant, WeightFormat, WeightFormatError
from ninfer_kernels.quant_formats import Int4Group, zeros_are_eight
from ninfer_plugins.weights.collect import LayerParts, LayerScheme, divides, expect_dtype, expect_shape
from ninfer_plugins.weights.packing import pack_int4, unpack_int4
from ninfer_plugins.weights.tiny_targets import dense_module_names, int4_layers

WHERE = "config.json quantization_config"


class GptqScheme(LayerScheme):
    def __init__(self, quant: dict):
        if quant.get("bits", 4) != 4:
            raise WeightFormatError(f"bits {quant.get('bits')}: only 4-bit GPTQ is read", WHERE)
        self.group = int(quant.get("group_size", 128))
        if self.group == -1:
            raise WeightFormatError("group_size -1 (one group per channel) is not read", WHERE)
        fmt = str(quant.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise WeightFormatError(f"checkpoint_format {fmt!r}: only gptq and gptq_v2 are read", WHERE)
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.desc_act = bool(quant.get("desc_act", False))
        required = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.desc_act else set())
        self.name = f"gptq int4, group {self.group}{', act-order' if self.desc_act else ''} ({fmt})"
        self.parts = LayerParts(
            format="gptq", parts=frozenset(required),
            required=lambda prefix, seen: required, build=self._build,
            dropped={} if self.desc_act else {"g_idx": "without desc_act every input's group is k // group_size"})

    def _build(self, prefix: str, parts: dict[str, torch.Tensor]) -> Int4Group:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        expect_dtype(qweight, (torch.int32,), f"{prefix}.qweight")
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        divides(self.group, k, f"{prefix}.qweight", f"the input size (group_size {self.group})")
        expect_shape(qzeros, (k // self.group, n // 8), f"{prefix}.qzeros", "the packed zero points")
        expect_shape(scales, (k // self.group, n), f"{prefix}.scales", "the group scales")
        if "g_idx" in parts:
            trivial = torch.arange(k) // self.group
            if not torch.equal(parts["g_idx"].long().cpu(), trivial):
                raise WeightFormatError("act-order (desc_act) with a permuted g_idx is not supported", f"{prefix}.g_idx")
        codes = unpack_int4(qweight, dim=0).t()  # [N, K]
        zeros = unpack_int4(qzeros, dim=-1).t().float() + self.zero_offset
        return Int4Group(pack_int4(codes), scales.t().contiguous(), zeros.contiguous(), self.group,
                         symmetric=zeros_are_eight(zeros))


def claim(config: dict, model_dir: Path) -> GptqScheme | None:
    quant = config.get("quantization_config") or {}
    return GptqScheme(quant) if quant.get("quant_method") == "gptq" else None


def write_tiny(config: dict, tensors: dict[str, torch.Tensor]) -> TinyQuant:
    """Symmetric GPTQ in the v1 layout (stored zero 7), with its trivial ``g_idx``."""
    def spell(module: str, w: torch.Tensor, q) -> dict[str, torch.Tensor]:
        return {f"{module}.qweight": pack_int4(unpack_int4(q.qweight).t(), dim=0),
                f"{module}.qzeros": pack_int4((q.zeros - 1).t().to(torch.int32), dim=-1),
                f"{module}.scales": q.scales.t().contiguous().to(w.dtype),
                f"{module}.g_idx": torch.arange(w.shape[1], dtype=torch.int32) // q.group_size}

    out, modules, group = int4_layers(tensors, symmetric=True, spell=spell)
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
             "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
             "lm_head": False, "modules_to_not_convert": dense_module_names(out, modules)}
    return TinyQuant(out, {"quantization_config": quant})


FORMAT = WeightFormat(
    name="gptq",
    claim=claim,
    tiny_writers={"gptq": write_tiny},
    description="GPTQ checkpoints (AutoGPTQ, GPTQModel): int4, group 128, v1 and v2 zero points",
)


@hookimpl
def register_weight_formats(register) -> None:
    register(FORMAT)
