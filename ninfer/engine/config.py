"""The engine's own settings, derived once from a resolved profile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ninfer.engine.context_cache import DescriptorLimits
from ninfer.engine.defaults import ProcessSamplingOverrides


@dataclass
class EngineConfig:
    max_context: int = 8192
    kv_capacity_tokens: int = 8192
    max_concurrency: int = 1
    prefill_chunk: int = 1024
    block_size: int = 16
    prefix_reuse: bool = True
    default_max_tokens: int = 8192
    thinking: bool = True
    kv_dtype: str = "bf16"
    #: speculative tokens proposed per decode row and round (0: no speculative decoding)
    draft_tokens: int = 0
    #: context-cache capacities (profile ``cache``); None when prefix reuse is off
    device_state_slots: Optional[int] = None  # snapshot rows on the device (hybrid families)
    host_state_slots: Optional[int] = None  # snapshot rows in pinned host memory
    host_kv_mib: Optional[int] = None  # host memory for evicted KV pages
    #: how many checkpoints of each kind the context cache keeps (ninfer.engine.context_cache)
    descriptor_limits: DescriptorLimits = field(default_factory=DescriptorLimits)
    #: ``--context-cost-presets FILE`` (None: generic defaults)
    context_cost_presets: Optional[str] = None
    process_sampling: ProcessSamplingOverrides = field(default_factory=ProcessSamplingOverrides)
