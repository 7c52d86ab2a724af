"""Putting quantized weights together: rows of a fused projection, experts of a stack.

A fused layer (``qkv_proj``, ``gate_up_proj``, Gated DeltaNet's ``in_proj``) is filled from
separate checkpoint tensors, each with its own scales. :func:`concat_rows` joins them into
one weight when the layout allows it, so the layer stays one matmul:

* :class:`Int4Group` and per-channel :class:`Fp8Block` (``bn == 1``): scales are per output
  row, so rows simply concatenate.
* :class:`Fp8Block` with ``bn > 1``: a scale covers ``bn`` rows, so every part but the last
  must have a multiple of ``bn`` rows (true of released checkpoints' 128 blocks and their
  head sizes); otherwise there is no shared layout and the caller keeps the parts apart.
* :class:`Nvfp4`: one ``alpha`` per weight. Released checkpoints give fused shards the
  same one (ModelOpt and llm-compressor both tie q/k/v and gate/up), and then they join
  exactly. When they differ they join only if the caller accepts ``rescale``: the larger
  alpha is kept and each part's e4m3 block scales are multiplied by ``alpha_i / alpha_max``
  (at most 1, so nothing overflows; rounding the product back to e4m3 costs up to 6% on
  a block's scale). Linear layers decline and keep such shards as separate segments;
  a MoE expert's gate and up must share one weight, so there it is accepted.

:func:`stack_experts` builds a MoE projection ``[E, N, K]`` from per-expert weights and
:func:`expert` takes one back out; the stacked :class:`Nvfp4` has one alpha per expert.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ninfer_kernels.quant_formats import Fp8Block, Int4Group, Nvfp4, QuantWeight

QUANT_TYPES = (Fp8Block, Int4Group, Nvfp4)


def is_quantized(value: object) -> bool:
    return isinstance(value, QUANT_TYPES)


def tensors(weight: QuantWeight) -> dict[str, torch.Tensor]:
    """The weight's tensor fields by name (what a module registers as its parameters)."""
    return {f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)
            if isinstance(getattr(weight, f.name), torch.Tensor)}


def register_params(module: torch.nn.Module, prefix: str, weight: QuantWeight) -> QuantWeight:
    """``weight`` with each tensor a frozen parameter of ``module`` named ``{prefix}_{field}``
    (so moves, byte counts and state dicts see them)."""
    params = {}
    for name, tensor in tensors(weight).items():
        params[name] = torch.nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(f"{prefix}_{name}", params[name])
    return dataclasses.replace(weight, **params)


def nbytes(weight: QuantWeight | torch.Tensor) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    return sum(t.nbytes for t in tensors(weight).values())


def to_device(weight: QuantWeight, device: torch.device | str, act_dtype: torch.dtype) -> QuantWeight:
    """On ``device``, with :class:`Int4Group`'s scales and zeros in the activation dtype."""
    moved = {name: t.to(device) for name, t in tensors(weight).items()}
    if isinstance(weight, Int4Group):
        moved["scales"] = moved["scales"].to(act_dtype)
        moved["zeros"] = moved["zeros"].to(act_dtype)
    return dataclasses.replace(weight, **moved)


def _same_columns(parts: Sequence[QuantWeight]) -> bool:
    return len({p.shape[-1] for p in parts}) == 1 and len({type(p) for p in parts}) == 1


def can_concat_rows(parts: Sequence[QuantWeight], rescale: bool = False) -> bool:
    """Whether :func:`concat_rows` can join ``parts`` into one weight (``rescale``: NVFP4
    parts with different alphas too, at the cost described above)."""
    if not parts or not _same_columns(parts):
        return False
    first = parts[0]
    if isinstance(first, Int4Group):
        return len({p.group_size for p in parts}) == 1
    if isinstance(first, Fp8Block):
        return all(p.block == first.block for p in parts) and not any(p.shape[-2] % first.block[0] for p in parts[:-1])
    return rescale or all(torch.equal(p.alpha.float(), first.alpha.float()) for p in parts)


def concat_rows(parts: Sequence[QuantWeight], rescale: bool = False) -> Optional[QuantWeight]:
    """``parts`` stacked along the output dimension as one weight; None when their layouts
    cannot be shared (different formats, group sizes or blocks, FP8 blocks cut mid-block,
    NVFP4 alphas that differ without ``rescale``)."""
    if not can_concat_rows(parts, rescale):
        return None
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, Int4Group):
        return Int4Group(torch.cat([p.qweight for p in parts], -2), torch.cat([p.scales for p in parts], -2),
                         torch.cat([p.zeros for p in parts], -2), first.group_size,
                         symmetric=all(p.symmetric for p in parts))
    if isinstance(first, Fp8Block):
        return Fp8Block(torch.cat([p.weight for p in parts], -2), torch.cat([p.scale for p in parts], -2), first.block)
    alpha = torch.stack([p.alpha.float() for p in parts]).amax(dim=0)
    scales = [_rescaled(p.scale, p.alpha.float() / alpha) for p in parts]
    return Nvfp4(torch.cat([p.packed for p in parts], -2), torch.cat(scales, -2), alpha)


def _rescaled(scale: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales times ``factor`` (a scalar, or one per expert), back in e4m3."""
    if bool((factor == 1).all()):
        return scale
    factor = factor.reshape(*factor.shape, *([1] * (scale.dim() - factor.dim())))
    return (scale.float() * factor).to(scale.dtype)


def stack_experts(experts: Sequence[QuantWeight]) -> QuantWeight:
    """Per-expert weights ``[N, K]`` as one ``[E, N, K]`` weight; raises ValueError when
    the experts do not share a layout."""
    first = experts[0]
    if len({type(e) for e in experts}) != 1 or len({tuple(e.shape) for e in experts}) != 1:
        raise ValueError("experts differ in format or shape")
    if isinstance(first, Int4Group):
        if len({e.group_size for e in experts}) != 1:
            raise ValueError("experts differ in group size")
        return Int4Group(*(torch.stack([getattr(e, f) for e in experts]) for f in ("qweight", "scales", "zeros")),
                         first.group_size, symmetric=all(e.symmetric for e in experts))
    if isinstance(first, Fp8Block):
        if len({e.block for e in experts}) != 1:
            raise ValueError("experts differ in FP8 block size")
        return Fp8Block(torch.stack([e.weight for e in experts]), torch.stack([e.scale for e in experts]), first.block)
    return Nvfp4(torch.stack([e.packed for e in experts]), torch.stack([e.scale for e in experts]),
                 torch.stack([e.alpha.float().reshape(()) for e in experts]))


def expert(weight: QuantWeight, index: int) -> QuantWeight:
    """Expert ``index`` of a stacked ``[E, N, K]`` weight."""
    fields = {name: t[index] for name, t in tensors(weight).items()}
    return dataclasses.replace(weight, **fields)


def take_rows(weight: QuantWeight, order: torch.Tensor) -> Optional[QuantWeight]:
    """The weight with its output rows reordered (row ``i`` of the result is row ``order[i]``),
    or None when the layout cannot express it: an :class:`Fp8Block` scale covers ``bn`` rows,
    so ``order`` must move whole, aligned blocks. (Qwen3-Next's head-grouped projections
    regroup in runs of head size, a multiple of 128 in its releases.)"""
    order = order.to(torch.long)
    if isinstance(weight, Fp8Block) and weight.block[0] > 1:
        bn = weight.block[0]
        n = weight.weight.shape[-2]
        if n % bn:
            return None
        runs = order.view(-1, bn)
        starts = runs[:, 0]
        if (starts % bn).any() or not torch.equal(runs, starts[:, None] + torch.arange(bn, device=order.device)):
            return None
        return dataclasses.replace(weight, weight=weight.weight[..., order.to(weight.weight.device), :],
                                   scale=weight.scale[..., (starts // bn).to(weight.scale.device), :])
    moved = {name: t[..., order.to(t.device), :] for name, t in tensors(weight).items()
             if t.dim() >= 2 and t.shape[-2] == weight.shape[-2]}  # per-row tensors (not Nvfp4's alpha)
    return dataclasses.replace(weight, **moved)
