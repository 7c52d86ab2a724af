"""Wiring a model's recurrent-state pool into a built engine (hybrid families only)."""

from __future__ import annotations

from typing import Optional

from loguru import logger

from ninfer.engine.state_slots import StateSlots


def state_pool_bytes(model, num_slots: int) -> int:
    """Device bytes the state pool of ``num_slots`` sequences will take (0 for most families)."""
    return model.state_bytes_per_slot() * num_slots


def allocate_state_slots(engine) -> Optional[StateSlots]:
    """Give ``engine``'s model one state slot per concurrent sequence and hand the slots to
    its scheduler; a model without recurrent state is left as it is (returns None)."""
    model = engine.model
    if model.state_bytes_per_slot() == 0:
        return None
    num_slots = engine.config.max_concurrency
    nbytes = model.allocate_state(num_slots, engine.device)
    slots = StateSlots(num_slots)
    engine.scheduler.attach_state_slots(slots)
    logger.info("recurrent state: {} slots, {:.1f} MiB", num_slots, nbytes / (1 << 20))
    return slots
