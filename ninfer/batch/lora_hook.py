"""The one place the batch runner hands LoRA adapters to the engine.

The runner hands over one adapter at a time: whatever this raises fails only the requests
naming that adapter, and is reported as a warning even when none does (see
:mod:`ninfer.batch.runner`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loguru import logger

from ninfer.lora import LoraAdapterError


def apply_lora(llm: Any, available: dict[str, str]) -> None:
    """Make the adapters in ``available`` (name -> adapter path) usable by ``llm``'s engine.

    A name already loaded from the same path is kept (runs may share one engine); the
    same name for a different path is an error, since its cached KV would be wrong.
    """
    loras = llm.engine.loras
    for name, path in available.items():
        if name in loras:
            loaded = loras.adapter(name).path
            if Path(loaded).resolve() != Path(path).resolve():
                raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded from {loaded}, not {path}")
            continue
        llm.load_lora(name, path)
        logger.info("loaded LoRA adapter {!r} from {}", name, path)
