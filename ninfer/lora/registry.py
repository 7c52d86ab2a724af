"""Loaded adapters by name, each with a slot, their weights placed into the model's layers.

Adapter modules are named as in the checkpoint (``...self_attn.q_proj``). A module that
is one of our LoRA-capable linear layers takes the adapter whole; one that our model
fuses (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) is found through the
parent's ``fused_shards()``, the same map the checkpoint loader uses, and lands on its
output rows of the fused layer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from ninfer.lora.adapter import LoraAdapter, LoraModule
from ninfer.lora.config import LoraAdapterError
from ninfer.lora.layer import NO_ADAPTER, LinearLora, LoraBatch, LoraContext

#: modules whose adaptation would need more than a linear delta on the step's rows
_UNSUPPORTED_LEAVES = {"lm_head": "the LM head", "embed_tokens": "the token embeddings"}


class LoraRegistry:
    """The adapters one model serves. Slots count from 1; 0 means no adapter."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.context = LoraContext()
        self._adapters: dict[str, LoraAdapter] = {}
        self._slots: dict[str, int] = {}
        self._layers: dict[str, LinearLora] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        return list(self._slots)

    def adapter(self, name: str) -> LoraAdapter:
        return self._adapters[name]

    def slot(self, name: Optional[str]) -> int:
        """The slot of a loaded adapter (KeyError when unknown); ``NO_ADAPTER`` for None."""
        return NO_ADAPTER if name is None else self._slots[name]

    # -- loading ---------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> int:
        """Read the PEFT adapter at ``path`` and serve it as ``name``; returns its slot."""
        if name in self._slots:
            raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded")
        return self.add(LoraAdapter.load(name, path))

    def add(self, adapter: LoraAdapter) -> int:
        """Serve an adapter already read; the model is untouched if it does not fit."""
        if adapter.name in self._slots:
            raise LoraAdapterError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        placed = self._place(adapter)  # validates everything before any layer changes
        slot = len(self._slots) + 1
        for target, (linear, a, b_t) in placed.items():
            layer = self._layers.get(target)
            if layer is None:
                out_features, in_features = linear.weight.shape
                layer = LinearLora(in_features, out_features, self.context, linear.weight)
                self._layers[target] = linear.lora = layer
            layer.set_slot(slot, a, b_t)
        self._adapters[adapter.name] = adapter
        self._slots[adapter.name] = slot
        return slot

    def _place(self, adapter: LoraAdapter) -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
        """Per target layer of ours: the layer, stacked ``A`` [R, in] and scaled ``B^T`` [R, out]."""
        modules = dict(self.model.named_modules())
        parts: dict[str, list[tuple[slice, LoraModule]]] = {}
        for module in adapter.modules:
            target, rows = self._route(adapter.name, module.name, modules)
            parts.setdefault(target, []).append((rows, module))
        placed = {}
        for target, pieces in parts.items():
            linear = modules[target]
            out_features, in_features = linear.weight.shape
            rank = sum(m.rank for _, m in pieces)
            a = torch.zeros(rank, in_features)
            b_t = torch.zeros(rank, out_features)
            start = 0
            for rows, m in pieces:
                width = len(range(out_features)[rows])
                if m.a.shape[1] != in_features or m.b.shape[0] != width:
                    raise LoraAdapterError(
                        f"adapter {adapter.name!r}: {m.name} is [{m.b.shape[0]} x {m.a.shape[1]}] "
                        f"(out x in); the model's layer is [{width} x {in_features}]"
                    )
                a[start : start + m.rank] = m.a.float()
                b_t[start : start + m.rank, rows] = (m.b.float() * m.scale).t()
                start += m.rank
            placed[target] = (linear, a, b_t)
        return placed

    @staticmethod
    def _route(adapter: str, name: str, modules: dict[str, nn.Module]) -> tuple[str, slice]:
        """Our linear layer for the adapter's module ``name``, and its output rows there."""
        parent, _, leaf = name.rpartition(".")
        if leaf in _UNSUPPORTED_LEAVES:
            raise LoraAdapterError(f"adapter {adapter!r}: LoRA on {_UNSUPPORTED_LEAVES[leaf]} is not supported")
        if hasattr(modules.get(name), "lora"):
            return name, slice(None)
        owner = modules.get(parent)
        shards = owner.fused_shards() if hasattr(owner, "fused_shards") else {}
        target, rows = (f"{parent}.{shards[leaf][0]}", shards[leaf][1]) if leaf in shards else (name, slice(None))
        if hasattr(modules.get(target), "lora"):
            return target, rows
        layout = getattr(modules.get(target), "quantized_layout", None)
        if layout:  # a quantized checkpoint's layer (ninfer_plugins.models.quant_linear)
            raise LoraAdapterError(f"adapter {adapter!r}: {name} is quantized in this checkpoint ({layout}); "
                                   "LoRA adapters apply to dense layers only")
        raise LoraAdapterError(f"adapter {adapter!r}: this model has no LoRA-capable linear layer {name!r}")

    # -- stepping --------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, batch: Optional[LoraBatch]) -> Iterator[None]:
        """Make ``batch`` the adapter layout the layers see during one forward pass."""
        self.context.batch = batch
        try:
            yield
        finally:
            self.context.batch = None
