"""The pieces an engine is assembled from, and the factories that build them.

Everything that needs the model, the config or the device is built before the engine
(:func:`ninfer.engine.builder.build_engine` calls these in the order device memory is
taken: KV pages, the recurrent-state pool, then the CUDA graphs captured over both) and
handed to :class:`~ninfer.engine.llm_engine.LLMEngine` as one :class:`EngineParts`. The
engine passes each piece to the constructor of the component that owns it (block
manager, scheduler, model runner), so nothing is attached to an engine afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Any, Optional, Sequence

import torch
from loguru import logger

from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cost import DEFAULT_COSTS, ContextCosts, generic_costs, load_presets
from ninfer.engine.cuda_graph import DecodeGraphs
from ninfer.engine.guided_setup import GuidedDecoding
from ninfer.engine.host_kv import HostKVTier
from ninfer.engine.spec.scratch import VerifyScratch
from ninfer.engine.state_cache import StateSnapshots
from ninfer.engine.state_slots import RecurrentState, StateSlots


@dataclass(frozen=True)
class KVPool:
    """The paged KV cache: one cache per attention layer, already bound to the model."""

    caches: list
    num_blocks: int
    #: how many of ``caches`` (the first ones) belong to the target; the rest to draft layers
    num_target: Optional[int] = None

    @property
    def draft_caches(self) -> list:
        return self.caches[self.num_target:] if self.num_target is not None else []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def capturable(self) -> bool:
        """Whether every cache's kernels may be captured in CUDA graphs."""
        return all(c.capturable for c in self.caches)

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page along dim 0 (what the host tier copies)."""
        return [t for cache in self.caches for t in cache.page_tensors()]


@dataclass(frozen=True)
class EngineParts:
    """What an engine is built from besides its model, tokenizer and config.

    ``state``: the recurrent-state slots, snapshots and speculative verify rows
    (families with state only); ``proposer``: drafts for speculative rounds;
    ``host_kv``: the host tier for evicted prefix pages; ``guided``: the guide compiler
    (None: guided requests are refused); ``graphs``: captured decode graphs (None: decode
    runs eagerly); ``decode_ahead``: launch the next decode step before the current
    one's tokens reach the host (:mod:`ninfer.engine.decode_ahead`).
    """

    kv: KVPool
    state: Optional[RecurrentState] = None
    host_kv: Optional[HostKVTier] = None
    guided: Optional[GuidedDecoding] = None
    graphs: Optional[DecodeGraphs] = None
    decode_ahead: bool = False
    #: the speculative backend's proposer (None: plain decoding; see ninfer.engine.spec)
    proposer: Optional[Any] = None
    #: captured verify steps (ninfer.engine.spec.verify_graphs.VerifyGraphs; None: eager)
    verify_graphs: Optional[Any] = None
    #: what recomputing and moving cached context costs (ninfer.engine.context_cost)
    costs: ContextCosts = DEFAULT_COSTS
    #: greedy speculative rounds run whole on the device
    #: (ninfer.engine.spec.device_rounds.DeviceRounds; None: the host drives every round)
    rounds: Optional[Any] = None


def allocate_kv_pool(model, kv_format, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                     draft_specs: Sequence = ()) -> KVPool:
    """The config's KV capacity in pages of ``config.block_size`` tokens, bound to ``model``;
    ``draft_specs``: a speculative backend's draft layers, paged alike (after the target's)."""
    bs = config.block_size
    num_blocks = ceil(config.kv_capacity_tokens / bs)
    specs = list(model.attention_specs())
    caches = [
        kv_format.allocate(num_blocks, bs, spec.num_kv_heads, spec.head_dim, dtype, device)
        for spec in [*specs, *draft_specs]
    ]
    model.bind_kv_caches(caches[: len(specs)])
    return KVPool(caches, num_blocks, len(specs))


def state_pool_bytes(model, num_slots: int) -> int:
    """Device bytes the state pool of ``num_slots`` rows will take (0 for most families)."""
    return model.state_bytes_per_slot() * num_slots


def snapshot_rows(config: EngineConfig) -> int:
    """Device snapshot rows the engine's config asks for (0: no prefix reuse, so none)."""
    return (config.device_state_slots or 0) if config.prefix_reuse else 0


def prefix_reuse_on(config: EngineConfig, state: Optional[RecurrentState]) -> bool:
    """The config asks for prefix reuse and, for a model with recurrent state, there are
    snapshots to resume a cached prefix from."""
    return config.prefix_reuse and (state is None or state.snapshots is not None)


def context_costs(model, config: EngineConfig, device: torch.device, names: Sequence[str]) -> ContextCosts:
    """The context-cost coefficients: generic estimates from the model's size, with the
    matching entries of ``config.context_cost_presets`` over them (checked at startup
    already; ``names``: the family, model id and reference an entry's ``model`` may match)."""
    params = sum(p.numel() for p in model.parameters())
    width = sum(s.num_kv_heads * s.head_dim for s in model.attention_specs())
    costs = generic_costs(params, width, device.type)
    if config.context_cost_presets is not None:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        costs = load_presets(config.context_cost_presets).resolve(costs, tuple(names), device_name)
    logger.info("context costs ({}): prefill {:.0f} ns a token + {:.1f} ns per 1000 tokens of context, host copies "
                "{:.1f} GB/s", costs.source, costs.prefill_ns_per_token, costs.depth_ns_per_token_per_ktoken,
                costs.host_gbps)
    return costs


def allocate_recurrent_state(model, config: EngineConfig, device: torch.device,
                             costs: ContextCosts = DEFAULT_COSTS, device_rounds: bool = False) -> Optional[RecurrentState]:
    """One state slot per concurrent sequence plus the snapshot rows, allocated in the
    model's pools; None for a model without recurrent state. With ``device_rounds`` and
    snapshots, the verify scratch rows come in two banks that rounds take in turn, so a
    round launched ahead never overwrites the rows the previous one's snapshots copy."""
    if model.state_bytes_per_slot() == 0:
        return None
    working, snap = config.max_concurrency, snapshot_rows(config)
    width = config.draft_tokens + 1 if config.draft_tokens else 0
    banks = 2 if device_rounds and snap and config.prefix_reuse else 1
    scratch_rows = VerifyScratch.rows_needed(working, width, banks)
    nbytes = model.allocate_state(working + snap + scratch_rows, device)
    snapshots = None
    if snap:
        snapshots = StateSnapshots(model.state_tensors(), working, snap, config.host_state_slots or 0, costs=costs)
    scratch = VerifyScratch(model.state_tensors(), working + snap, working, width, banks) if width else None
    state = RecurrentState(StateSlots(working), snapshots, scratch)
    if config.prefix_reuse and not prefix_reuse_on(config, state):
        logger.info("prefix reuse is off: this model keeps recurrent state and has no snapshot slots")
    host = ""
    if snapshots is not None:
        host = f", {snapshots.num_host} host snapshot rows ({snapshots.host_bytes / (1 << 20):.1f} MiB)"
    verify = f" + {scratch_rows} speculative verify rows" if scratch_rows else ""
    if banks > 1 and scratch_rows:
        verify += " (two banks: rounds on the device run ahead of their snapshots)"
    logger.info(
        "recurrent state: {} slots + {} snapshot rows{}, {:.1f} MiB on the device{}",
        working, snap, verify, nbytes / (1 << 20), host,
    )
    return state


def build_host_kv(kv: KVPool, config: EngineConfig, prefix_reuse: bool) -> Optional[HostKVTier]:
    """Keep evicted prefix pages in host memory (up to ``config.host_kv_mib``); None when
    the config asks for none or prefix reuse is off."""
    if not (prefix_reuse and config.host_kv_mib):
        return None
    tier = HostKVTier(kv.page_tensors(), config.host_kv_mib << 20)
    if tier.capacity == 0:
        return None
    logger.info(
        "host KV tier: up to {} pages ({} MiB{}), allocated as pages spill",
        tier.capacity, config.host_kv_mib, ", pinned" if tier.pin else "",
    )
    return tier
