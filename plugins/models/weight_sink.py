"""Where a family's loader puts each checkpoint tensor once it has found its parameter.

A family routes every checkpoint name to ``(parameter, index)`` (fused projections and
stacked experts take slices); the sink does the rest, the same way for every family:

* a dense tensor for a parameter that has storage is copied into place;
* a quantized weight (from a weight-format plugin, :mod:`ninfer.model.weight_format`) for a
  :class:`Linear`, and anything for a linear layer built without storage (a quantized
  checkpoint's), is collected per layer; at :meth:`WeightSink.finish` the layer becomes a
  :class:`QuantLinear` when any shard is quantized, else gets its dense storage;
* stacked experts likewise become one quantized ``[E, N, K]`` weight per projection;
* a layer that stays dense by design (embeddings, the LM head, MoE routers: ``quantizable``
  False) takes a quantized checkpoint tensor dequantized, with a log line.

``finish`` fails on gaps, naming the parameters the checkpoint left unfilled.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from loguru import logger
from torch import nn

from ninfer.model.weight_format import WeightFormatError
from ninfer_kernels import quant_rows
from ninfer_plugins.models.layers import Linear
from ninfer_plugins.models.moe import Experts
from ninfer_plugins.models.quant_linear import QuantLinear, join_shards


class WeightSink:
    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.filled = dict.fromkeys(self.params, 0)
        real = next(p for p in self.params.values() if not p.is_meta and p.is_floating_point())
        self.device, self.dtype = real.device, real.dtype
        self._linear_shards: dict[str, list[tuple[slice, Any, str]]] = {}
        self._expert_shards: dict[str, list[tuple[tuple, Any, str]]] = {}  # keyed by parameter name
        self._dequantized: Counter[str] = Counter()

    def put(self, source: str, param_name: str, index: tuple, value: Any) -> None:
        """``value`` (a tensor or a quantized weight, from checkpoint tensor ``source``) into
        ``param_name[index]``."""
        owner_name, _, leaf = param_name.rpartition(".")
        owner = self.modules[owner_name]
        param = self.params[param_name]
        quantized = quant_rows.is_quantized(value)
        if quantized and not _takes_quantized(owner, leaf):
            self._dequantized[type(owner).__name__] += 1
            value, quantized = value.dequantize(self.dtype), False
        expected = param.data[index].shape
        if tuple(value.shape) != tuple(expected):
            raise WeightFormatError(f"checkpoint shape {tuple(value.shape)}, model expects {tuple(expected)}", source)
        # collected shards wait on the device, so the host holds one checkpoint tensor at a time
        if isinstance(owner, Linear) and leaf == "weight" and (quantized or param.is_meta):
            rows = index[0] if index else slice(None)
            self._linear_shards.setdefault(owner_name, []).append((rows, self._on_device(value), source))
        elif isinstance(owner, Experts) and (quantized or param.is_meta):
            self._expert_shards.setdefault(param_name, []).append((index, self._on_device(value), source))
        else:
            param.data[index].copy_(value)
            self.filled[param_name] += param.data[index].numel()

    def finish(self, optional: str | None = None) -> bool:
        """Assemble the collected layers and check that nothing is missing. Parameters under
        the ``optional`` prefix may be absent altogether, not in part; returns whether they
        were loaded."""
        # popped as they are assembled: joining and stacking copy, and holding every collected
        # piece until the end would need the quantized model's size twice on the device
        while self._linear_shards:
            self._finish_linear(*self._linear_shards.popitem())
        while self._expert_shards:
            self._finish_experts(*self._expert_shards.popitem())
        for kind, count in self._dequantized.items():
            logger.info("{} quantized checkpoint tensor(s) of {} layers dequantized: ninfer keeps those layers dense",
                        count, kind)
        extra = [n for n in self.params if optional and n.startswith(optional)]
        has_optional = any(self.filled[n] for n in extra)
        if extra and not has_optional:
            self.filled.update((n, self.params[n].numel()) for n in extra)
        missing = [n for n, p in self.params.items() if self.filled[n] < p.numel()]
        if missing:
            raise ValueError(
                f"checkpoint leaves {len(missing)} model parameter(s) unfilled or partly filled: {missing[:5]}")
        return has_optional

    # -- assembling ------------------------------------------------------------------
    def _finish_linear(self, name: str, shards: list[tuple[slice, Any, str]]) -> None:
        linear: Linear = self.modules[name]
        param_name = f"{name}.weight"
        out_features, in_features = self.params[param_name].shape
        if not any(quant_rows.is_quantized(w) for _, w, _ in shards):
            weight = self._materialize(linear, "weight", param_name)
            for rows, tensor, _ in shards:
                weight.data[rows].copy_(tensor)
                self.filled[param_name] += weight.data[rows].numel()
            return
        layer = QuantLinear(in_features, out_features, join_shards(shards, out_features, name), linear.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(self.modules[parent], leaf, layer)
        self.modules[name] = layer
        self.filled[param_name] = self.params[param_name].numel()

    def _finish_experts(self, param_name: str, shards: list[tuple[tuple, Any, str]]) -> None:
        owner_name, _, leaf = param_name.rpartition(".")
        experts: Experts = self.modules[owner_name]
        param = self.params[param_name]
        if not any(quant_rows.is_quantized(w) for _, w, _ in shards):
            param = self._materialize(experts, leaf, param_name)
            for index, tensor, _ in shards:
                param.data[index].copy_(tensor)
                self.filled[param_name] += param.data[index].numel()
            return
        num_experts, rows = param.shape[0], param.shape[1]
        per_expert: list[list[tuple[slice, Any, str]]] = [[] for _ in range(num_experts)]
        for index, weight, source in shards:
            if len(index) == 0:
                raise WeightFormatError("a quantized stacked expert tensor is not a layout ninfer reads; "
                                        "quantized experts load one tensor per expert", source)
            per_expert[index[0]].append((index[1] if len(index) > 1 else slice(None), weight, source))
        stacked = []
        for e, expert_shards in enumerate(per_expert):
            where = f"{param_name}[{e}]"
            segments = join_shards(expert_shards, rows, where, rescale=True)
            if len(segments) != 1 or not quant_rows.is_quantized(segments[0]):
                raise WeightFormatError(
                    "the expert's projections do not share one quantized layout (an FP8 block that the "
                    "intermediate size cuts mid-block, or quantized and dense projections mixed)", where)
            stacked.append(segments[0])
        try:
            experts.set_quantized(leaf, quant_rows.stack_experts(stacked))
        except ValueError as e:
            raise WeightFormatError(str(e), param_name) from None
        self.filled[param_name] = param.numel()

    def _materialize(self, owner: nn.Module, leaf: str, param_name: str) -> nn.Parameter:
        """Storage for a parameter built without it (a meta tensor cannot take data in place)."""
        param = nn.Parameter(torch.empty(self.params[param_name].shape, dtype=self.dtype, device=self.device),
                             requires_grad=False)
        setattr(owner, leaf, param)
        self.params[param_name] = param
        return param

    def _on_device(self, weight: Any) -> Any:
        if isinstance(weight, torch.Tensor):
            return weight.to(self.device, self.dtype)
        return quant_rows.to_device(weight, self.device, self.dtype)


def _takes_quantized(owner: nn.Module, leaf: str) -> bool:
    if isinstance(owner, Linear):
        return leaf == "weight" and owner.quantizable
    return isinstance(owner, Experts)
