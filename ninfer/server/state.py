"""What every protocol adapter gets: the engine, the tokenizer, and the server's rules.

Protocol plugins receive one :class:`ServerState` in ``Protocol.routes(state)`` and
close over it in their handlers (no global service locator).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from ninfer.engine.async_engine import AsyncEngine
from ninfer.engine.request import EngineRequest, GenerationEvent

T = TypeVar("T")


@dataclass
class ServerState:
    profile: Any  # resolved ninfer.profile.Profile
    registry: Any  # ninfer.plugins.PluginRegistry
    engine: AsyncEngine
    tokenizer: Any  # ninfer.tokenizer.Tokenizer
    family: Any  # ninfer.model.family.ModelFamily
    model_id: str
    max_model_len: int
    gate: Any  # ninfer.server.admission.AdmissionGate
    extras: dict[str, Any] = field(default_factory=dict)  # per-protocol shared objects

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Tokenizing and template rendering run off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationEvent]:
        """Admission control (429 / 503), then the engine's event stream.

        Raises a typed :class:`ninfer.errors.NinferError` before the first event when
        the request is rejected; closing the iterator cancels the request.
        """
        async for event in self.gate.generate(self.engine, request):
            yield event
