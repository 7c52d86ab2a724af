"""Wiring a built engine's context cache: state slots and snapshots (hybrid families),
and the host KV tier (every family)."""

from __future__ import annotations

from typing import Optional

from loguru import logger

from ninfer.engine.host_kv import HostKVTier
from ninfer.engine.state_cache import StateSnapshots
from ninfer.engine.state_slots import StateSlots


def state_pool_bytes(model, num_slots: int) -> int:
    """Device bytes the state pool of ``num_slots`` rows will take (0 for most families)."""
    return model.state_bytes_per_slot() * num_slots


def snapshot_rows(config) -> int:
    """Device snapshot rows the engine's config asks for (0: no prefix reuse, so none)."""
    return (config.device_state_slots or 0) if config.prefix_reuse else 0


def allocate_state_slots(engine) -> Optional[StateSlots]:
    """Give ``engine``'s model one state slot per concurrent sequence plus its snapshot rows,
    and hand both to its scheduler; a model without recurrent state is left as it is
    (returns None)."""
    model, config = engine.model, engine.config
    if model.state_bytes_per_slot() == 0:
        return None
    working, snap = config.max_concurrency, snapshot_rows(config)
    nbytes = model.allocate_state(working + snap, engine.device)
    slots = StateSlots(working)
    snapshots = None
    if snap:
        snapshots = StateSnapshots(model.state_tensors(), working, snap, config.host_state_slots or 0)
    engine.scheduler.attach_state_slots(slots, snapshots)
    host = ""
    if snapshots is not None:
        host = f", {snapshots.num_host} host snapshot rows ({snapshots.host_bytes / (1 << 20):.1f} MiB)"
    logger.info(
        "recurrent state: {} slots + {} snapshot rows, {:.1f} MiB on the device{}",
        working, snap, nbytes / (1 << 20), host,
    )
    return slots


def attach_host_kv(engine) -> Optional[HostKVTier]:
    """Keep evicted prefix pages in host memory (up to ``config.host_kv_mib``); None when
    the config asks for none or prefix reuse is off."""
    config = engine.config
    if not (engine.block_manager.enable_prefix_reuse and config.host_kv_mib):
        return None
    tensors = [t for cache in engine.kv_caches for t in cache.page_tensors()]
    tier = HostKVTier(tensors, config.host_kv_mib << 20)
    if tier.capacity == 0:
        return None
    engine.block_manager.host_kv = tier
    logger.info(
        "host KV tier: up to {} pages ({} MiB{}), allocated as pages spill",
        tier.capacity, config.host_kv_mib, ", pinned" if tier.pin else "",
    )
    return tier
