"""Serving PEFT LoRA adapters: several adapters (and none) side by side in one batch."""

from ninfer.lora.adapter import LoraAdapter, LoraModule
from ninfer.lora.config import AdapterConfig, LoraAdapterError
from ninfer.lora.layer import NO_ADAPTER, LinearLora, LoraBatch, LoraContext
from ninfer.lora.registry import LoraRegistry

__all__ = [
    "NO_ADAPTER",
    "AdapterConfig",
    "LinearLora",
    "LoraAdapter",
    "LoraAdapterError",
    "LoraBatch",
    "LoraContext",
    "LoraModule",
    "LoraRegistry",
]
