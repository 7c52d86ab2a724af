"""compressed-tensors checkpoints (llm-compressor's output, ``quant_method: compressed-tensors``).

``quantization_config.config_groups`` maps module ``targets`` to a scheme; ``ignore`` lists
modules left dense (exact names or ``re:`` patterns). Three schemes are read, each into
one of the in-memory layouts:

* FP8 (``float-quantized``; FP8_DYNAMIC, FP8_BLOCK): ``weight`` float8_e4m3fn and
  ``weight_scale`` per channel ``[N, 1]``, per tensor, or per block (``block_structure``)
  -> :class:`Fp8Block` (a per-tensor scale becomes a per-channel one, so fused shards join).
* int4 weight-only (``pack-quantized``; W4A16, group 128): ``weight_packed`` int32
  ``[N, K/8]`` (eight codes per word along K, each the signed value + 8), ``weight_scale``
  ``[N, K/G]``, ``weight_shape``, and for asymmetric schemes ``weight_zero_point`` packed
  along N -> :class:`Int4Group` (zero 8 when symmetric). Activation ordering with a
  non-trivial ``weight_g_idx`` is refused.
* NVFP4 (``nvfp4-pack-quantized``): ``weight_packed`` uint8 ``[N, K/2]``, ``weight_scale``
  e4m3 ``[N, K/16]``, ``weight_global_scale``; the real weight is
  ``e2m1 * weight_scale / weight_global_scale``, so alpha = ``1 / weight_global_scale``.

Activation scales (``input_scale``, ``input_global_scale``) are not read: the kernels
quantize activations on the fly or not at all (weight-only on Hopper).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from ninfer.hookspecs import hookimpl
from ninfer.model.weight_format import WeightFormat, WeightFormatError
from ninfer_kernels.quant_formats import Fp8Block, Int4Group, Nvfp4, zeros_are_eight
from ninfer_plugins.weights import ct_tiny
from ninfer_plugins.weights.collect import (
    ACTIVATION_SCALE, KV_SCALES, LayerParts, LayerScheme, best_ct_target, divides, expect_dtype,
    expect_matrix, expect_shape, matches_ct,
)
from ninfer_plugins.weights.packing import unpack_int4

WHERE = "config.json quantization_config"
FP8, INT4, NVFP4 = "fp8", "int4", "nvfp4"
PARTS = {
    FP8: {"weight", "weight_scale"},
    INT4: {"weight_packed", "weight_scale", "weight_shape"},
    NVFP4: {"weight_packed", "weight_scale", "weight_global_scale"},
}
DROPPED = {"input_scale": ACTIVATION_SCALE, "input_global_scale": ACTIVATION_SCALE,
           "input_zero_point": ACTIVATION_SCALE, **KV_SCALES}


@attrs.frozen
class Group:
    """One config group: which modules, which layout, and its arguments."""

    name: str
    targets: tuple[str, ...]
    kind: str
    weights: dict

    def required(self) -> set[str]:
        parts = set(PARTS[self.kind])
        if self.kind == INT4 and not self.weights.get("symmetric", True):
            parts.add("weight_zero_point")
        if self.kind == INT4 and self.weights.get("actorder") == "group":
            parts.add("weight_g_idx")
        return parts


def _group(name: str, spec: dict, default_format: str | None) -> Group:
    fmt = spec.get("format") or default_format
    w = spec.get("weights") or {}
    where = f"{WHERE}.config_groups.{name}"
    bits, kind = w.get("num_bits"), w.get("type")
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        if w.get("strategy") not in ("channel", "tensor", "block"):
            raise WeightFormatError(f"FP8 weights with strategy {w.get('strategy')!r} are not read", where)
        return Group(name, tuple(spec.get("targets") or ()), FP8, w)
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        if w.get("strategy") not in ("group", "channel"):
            raise WeightFormatError(f"int4 weights with strategy {w.get('strategy')!r} are not read", where)
        return Group(name, tuple(spec.get("targets") or ()), INT4, w)
    if fmt == "nvfp4-pack-quantized" and kind == "float" and bits == 4:
        if w.get("group_size", 16) != 16:
            raise WeightFormatError(f"NVFP4 with group_size {w.get('group_size')} (the format has 16)", where)
        return Group(name, tuple(spec.get("targets") or ()), NVFP4, w)
    raise WeightFormatError(f"format {fmt!r} with {bits}-bit {kind} weights is not a layout ninfer reads "
                            "(it reads FP8, int4 pack-quantized and NVFP4)", where)


class CompressedTensorsScheme(LayerScheme):
    def __init__(self, quant: dict):
        for key in ("sparsity_config", "transform_config"):
            if quant.get(key):
                raise WeightFormatError(f"{key} is set: sparse or transformed compressed-tensors checkpoints are "
                                        "not read", f"{WHERE}.{key}")
        groups = quant.get("config_groups") or {}
        self.groups = [_group(name, spec, quant.get("format")) for name, spec in groups.items()]
        if not self.groups:
            raise WeightFormatError("no config_groups", WHERE)
        # each target's group, a later group taking a target an earlier one names (as the
        # library's own target-to-scheme map does)
        self.by_target = {target: group for group in self.groups for target in group.targets}
        self.ignore = tuple(quant.get("ignore") or ())
        kinds = sorted({_describe(g) for g in self.groups})
        self.name = f"compressed-tensors {', '.join(kinds)}"
        self.parts = LayerParts(
            # a quantized ``weight`` (FP8) is told from a dense one by its dtype
            format="compressed-tensors",
            parts=frozenset(set().union(*PARTS.values(), {"weight_zero_point", "weight_g_idx"}) - {"weight"}),
            required=lambda prefix, seen: self.group_of(prefix).required(), build=self._build, dropped=DROPPED)

    def group_of(self, module: str) -> Group:
        if matches_ct(module, self.ignore):
            raise WeightFormatError("has quantized tensors, but the config's ignore list keeps it dense", module)
        # where groups overlap, the most specific target wins: an exact name over a
        # regular expression over the ``Linear`` class
        target = best_ct_target(module, self.by_target)
        if target is None:
            raise WeightFormatError("has quantized tensors, but no config group targets it", module)
        return self.by_target[target]

    def _build(self, prefix: str, parts: dict[str, torch.Tensor]) -> Any:
        group = self.group_of(prefix)
        return {FP8: _fp8, INT4: _int4, NVFP4: _nvfp4}[group.kind](prefix, parts, group.weights)


def _describe(group: Group) -> str:
    w = group.weights
    if group.kind == FP8:
        return f"fp8 e4m3 per {w.get('strategy')}" + (f" {w.get('block_structure')}" if w.get("block_structure") else "")
    if group.kind == INT4:
        size = f"group {w.get('group_size')}" if w.get("strategy") == "group" else "channel"
        return f"int4 {'symmetric' if w.get('symmetric', True) else 'asymmetric'} {size} (W4A16)"
    return "nvfp4 (e2m1, e4m3 scale per 16)"


def _fp8(prefix: str, parts: dict[str, torch.Tensor], args: dict) -> Fp8Block:
    weight, scale = parts["weight"], parts["weight_scale"].float()
    expect_dtype(weight, (torch.float8_e4m3fn,), f"{prefix}.weight")
    n, k = expect_matrix(weight, f"{prefix}.weight")
    name = f"{prefix}.weight_scale"
    if args.get("strategy") == "block":
        bn, bk = args.get("block_structure") or (None, None)
        if not (bn and bk):
            raise WeightFormatError("block strategy without block_structure", WHERE)
        expect_shape(scale, (-(-n // bn), -(-k // bk)), name, f"the scale of {bn}x{bk} blocks")
        return Fp8Block(weight, scale, (bn, bk))
    if args.get("strategy") == "tensor":
        if scale.numel() != 1:
            raise WeightFormatError(f"a per-tensor scale has {scale.numel()} values", name)
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.numel() != n:
        raise WeightFormatError(f"a per-channel scale has {scale.numel()} values for {n} output channels", name)
    return Fp8Block(weight, scale.reshape(n, 1).contiguous(), (1, k))


def _int4(prefix: str, parts: dict[str, torch.Tensor], args: dict) -> Int4Group:
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    expect_dtype(packed, (torch.int32,), f"{prefix}.weight_packed")
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    divides(8, k, f"{prefix}.weight_shape", "the input size")
    expect_shape(packed, (n, k // 8), f"{prefix}.weight_packed", "the packed weight")
    group = args.get("group_size") if args.get("strategy") == "group" else k
    divides(group, k, f"{prefix}.weight_shape", f"the input size (group_size {group})")
    expect_shape(scale, (n, k // group), f"{prefix}.weight_scale", "the group scales")
    if "weight_g_idx" in parts:
        trivial = torch.arange(k, device=parts["weight_g_idx"].device) // group
        if not torch.equal(parts["weight_g_idx"].long(), trivial):
            raise WeightFormatError("activation ordering (a permuted g_idx) is not supported", f"{prefix}.weight_g_idx")
    if "weight_zero_point" in parts:
        zp = parts["weight_zero_point"]
        expect_dtype(zp, (torch.int32,), f"{prefix}.weight_zero_point")
        expect_shape(zp, (-(-n // 8), k // group), f"{prefix}.weight_zero_point", "the packed zero points")
        zeros = unpack_int4(zp, dim=0)[:n].float()
    else:
        zeros = torch.full((n, k // group), 8.0)
    return Int4Group(packed, scale, zeros, group, symmetric=zeros_are_eight(zeros))


def _nvfp4(prefix: str, parts: dict[str, torch.Tensor], args: dict) -> Nvfp4:
    packed, scale, global_scale = parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"]
    expect_dtype(packed, (torch.uint8,), f"{prefix}.weight_packed")
    expect_dtype(scale, (torch.float8_e4m3fn,), f"{prefix}.weight_scale")
    n, half = packed.shape
    divides(16, 2 * half, f"{prefix}.weight_packed", "the input size")
    expect_shape(scale, (n, 2 * half // 16), f"{prefix}.weight_scale", "the block scales")
    if global_scale.numel() != 1:
        raise WeightFormatError(f"has {global_scale.numel()} values, expected one", f"{prefix}.weight_global_scale")
    return Nvfp4(packed, scale, (1.0 / global_scale.float()).reshape(()))


def claim(config: dict, model_dir: Path) -> CompressedTensorsScheme | None:
    quant = config.get("quantization_config") or {}
    return CompressedTensorsScheme(quant) if quant.get("quant_method") == "compressed-tensors" else None


FORMAT = WeightFormat(
    name="compressed-tensors",
    claim=claim,
    tiny_writers={"ct-fp8": ct_tiny.write_fp8, "ct-w4a16": ct_tiny.write_w4a16, "ct-nvfp4": ct_tiny.write_nvfp4},
    description="llm-compressor checkpoints: FP8 (per channel or block), int4 W4A16, NVFP4",
)


@hookimpl
def register_weight_formats(register) -> None:
    register(FORMAT)
