"""The linear layer of a quantized checkpoint: ``y = x W^T (+ b)`` with ``W`` in a quantized layout.

The loader puts a :class:`QuantLinear` where a :class:`ninfer_plugins.models.layers.Linear`
was whenever the checkpoint quantizes that layer (:mod:`ninfer_plugins.models.weight_sink`).
Its weight is one of :mod:`ninfer_kernels.quant_formats`' layouts and the product runs
through ``ops.quant_linear`` (a Triton kernel on CUDA, dequantize-then-matmul elsewhere).

A fused projection is filled from separate checkpoint tensors. When their layouts join
(:func:`ninfer_kernels.quant_rows.concat_rows`) the layer holds one weight; when they do not
(an FP8 block cut mid-block, or shards the checkpoint left unquantized, such as Qwen3.5
FP8's ``in_proj_b`` / ``in_proj_a`` beside its quantized ``in_proj_qkv`` / ``in_proj_z``) it
holds consecutive row *segments*, one product each, concatenated. The weights' tensors are
registered as parameters, so device moves and byte counts (memory ledger, bandwidth
figures) see them like any other weight.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ninfer.model.weight_format import WeightFormatError
from ninfer_kernels import ops, quant_rows
from ninfer_kernels.quant_formats import QuantWeight

Segment = QuantWeight | torch.Tensor


class QuantLinear(nn.Module):
    """``segments``: the weight's consecutive output rows, each quantized or dense ``[rows, in]``."""

    def __init__(self, in_features: int, out_features: int, segments: Sequence[Segment], bias: nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.segments: list[Segment] = [self._register(i, s) for i, s in enumerate(segments)]
        #: what LoRA and the logs report: the layouts this layer holds
        self.quantized_layout = "+".join(sorted({type(s).__name__ for s in self.segments if quant_rows.is_quantized(s)}))

    def _register(self, index: int, segment: Segment) -> Segment:
        if isinstance(segment, torch.Tensor):
            param = nn.Parameter(segment, requires_grad=False)
            self.register_parameter(f"part{index}_weight", param)
            return param
        return quant_rows.register_params(self, f"part{index}", segment)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.segments) == 1:
            return _product(x, self.segments[0], self.bias)
        y = torch.cat([_product(x, s, None) for s in self.segments], dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        widths = [s.shape[-2] for s in self.segments]
        return f"in={self.in_features}, out={self.out_features}, {self.quantized_layout}, segments={widths}"


def _product(x: torch.Tensor, weight: Segment, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return ops.linear(x, weight, bias)
    return ops.quant_linear(x, weight, bias)


def join_shards(shards: Sequence[tuple[slice, Segment, str]], out_features: int, layer: str,
                rescale: bool = False) -> list[Segment]:
    """A fused layer's shards ``(rows, weight, checkpoint name)`` as its fewest segments.

    Shards must cover rows ``0 .. out_features`` exactly once. Consecutive quantized shards
    join where their layouts allow (``rescale``: see :func:`ninfer_kernels.quant_rows.concat_rows`),
    consecutive dense ones always."""
    ordered = sorted(shards, key=lambda s: s[0].start or 0)
    runs: list[list[Segment]] = []
    end = 0
    for rows, weight, name in ordered:
        start, stop, _ = rows.indices(out_features)
        if start != end:
            raise WeightFormatError(f"rows {end}..{start} of {layer} are not in the checkpoint" if start > end
                                    else f"overlaps rows already filled in {layer}", name)
        if weight.shape[-2] != stop - start:
            raise WeightFormatError(f"has {weight.shape[-2]} rows, {layer} expects {stop - start} there", name)
        end = stop
        last = runs[-1] if runs else None
        if last is not None and _joins(last, weight, rescale):
            last.append(weight)
        else:
            runs.append([weight])
    if end != out_features:
        raise WeightFormatError(f"rows {end}..{out_features} are not in the checkpoint", layer)
    return [run[0] if len(run) == 1 else _join(run, rescale) for run in runs]


def _joins(run: list[Segment], weight: Segment, rescale: bool) -> bool:
    dense = isinstance(weight, torch.Tensor)
    if dense != isinstance(run[0], torch.Tensor):
        return False
    return dense or quant_rows.can_concat_rows([*run, weight], rescale)


def _join(run: list[Segment], rescale: bool) -> Segment:
    if isinstance(run[0], torch.Tensor):
        return torch.cat(run, dim=0)
    joined = quant_rows.concat_rows(run, rescale)
    assert joined is not None  # _joins checked it
    return joined
