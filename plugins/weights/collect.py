"""What every weight format's ``convert`` shares: gathering each quantized layer's tensors.

A quantized linear layer ``P`` is stored as several tensors ``P.<part>`` (a packed weight,
its scales, zero points, ...), not necessarily next to each other in the files. A format
names the parts it reads (:class:`LayerParts`); :func:`convert_layers` holds each layer's
parts until it has the ones the format requires for that layer, then yields the layer as
one ``(P.weight, QuantWeight)``. Parts the format does not need (activation scales for
kernels that quantize activations on the fly, KV-cache scales) are dropped. Every other
tensor passes through, so dense layers, norms and embeddings load as usual. A layer still
incomplete when the files end is refused, naming the missing tensor.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Optional

import attrs
import torch
from loguru import logger

from ninfer.model.weight_format import WeightFormatError

DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@attrs.frozen
class LayerParts:
    """``parts``: tensor suffixes that only quantized layers have; ``weight`` belongs to a
    quantized layer when its dtype is not a float one (FP8, packed bytes). ``required(P,
    seen)`` -> the suffixes layer ``P`` needs; ``build(P, parts)`` -> its ``QuantWeight``.
    ``dropped``: suffixes read past without use, with why (logged once)."""

    format: str
    parts: frozenset[str]
    required: Callable[[str, dict], set[str]]
    build: Callable[[str, dict], Any]
    dropped: dict[str, str] = attrs.field(factory=dict)


#: why the checkpoint tensors the formats share are read past
ACTIVATION_SCALE = "activations are quantized on the fly (or kept) by the kernels"
KV_SCALES = {"k_scale": "the KV format is the profile's choice", "v_scale": "the KV format is the profile's choice"}


class LayerScheme:
    """What the schemes built on :class:`LayerParts` share: ``convert`` streams the
    checkpoint through :func:`convert_layers` with the scheme's ``parts``."""

    parts: LayerParts

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        return convert_layers(weights, self.parts)


def is_quantized_weight(tensor: torch.Tensor) -> bool:
    return tensor.dtype not in DENSE_DTYPES


def convert_layers(stream: Iterable[tuple[str, torch.Tensor]], spec: LayerParts) -> Iterator[tuple[str, Any]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped: Counter[str] = Counter()
    for name, tensor in stream:
        prefix, _, suffix = name.rpartition(".")
        if suffix in spec.dropped:
            dropped[suffix] += 1
            continue
        if suffix not in spec.parts and not (suffix == "weight" and is_quantized_weight(tensor)):
            yield name, tensor
            continue
        group = pending.setdefault(prefix, {})
        group[suffix] = tensor
        if spec.required(prefix, group) <= group.keys():
            yield f"{prefix}.weight", spec.build(prefix, pending.pop(prefix))
    for suffix, count in dropped.items():
        logger.info("{}: {} '{}' tensor(s) not used: {}", spec.format, count, suffix, spec.dropped[suffix])
    for prefix, group in pending.items():
        missing = sorted(spec.required(prefix, group) - group.keys())
        raise WeightFormatError(f"missing from the checkpoint ({spec.format} layer with {', '.join(sorted(group))})",
                                f"{prefix}.{missing[0]}")


def expect_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, what: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise WeightFormatError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(shape)}", name)


def expect_matrix(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """A linear layer's weight ``[out, in]``: its two sizes, or an error naming the tensor."""
    if tensor.dim() != 2:
        raise WeightFormatError(f"a linear weight has 2 dimensions, this one {tensor.dim()} "
                                f"(shape {tuple(tensor.shape)})", name)
    return tensor.shape[0], tensor.shape[1]


def expect_dtype(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str) -> None:
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise WeightFormatError(f"dtype {str(tensor.dtype).removeprefix('torch.')}, expected {allowed}", name)


def divides(block: int, size: int, name: str, what: str) -> None:
    if block <= 0 or size % block:
        raise WeightFormatError(f"{what} {size} is not a multiple of {block}", name)


def matches_ct(module: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' module lists: exact names, or ``re:`` regular expressions matched
    from the start of the name (``Linear``, a class name, matches every linear layer)."""
    return best_ct_target(module, patterns) is not None


def best_ct_target(module: str, patterns: Iterable[str]) -> Optional[str]:
    """The most specific of ``patterns`` that matches ``module``, ranked as compressed-tensors
    ranks a layer's matches when config groups overlap: exact names, then regular
    expressions (each kind in sorted order), then the ``Linear`` class; None when none does."""
    ranked = sorted(patterns, key=lambda p: (p.startswith("re:"), p))
    for pattern in ranked:
        if pattern == module or (pattern.startswith("re:") and re.match(pattern[3:], module)):
            return pattern
    return "Linear" if "Linear" in ranked else None
