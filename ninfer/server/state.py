"""What every protocol adapter gets: the engine, the tokenizer, and the server's rules.

Protocol plugins receive one :class:`ServerState` in ``Protocol.routes(state)`` and
close over it in their handlers (no global service locator). It is the pipeline's
:class:`ninfer.frontend.host.ServingHost`; what a protocol needs of the model (its
vocabulary size, say) is a field here, so no protocol reaches into the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, TypeVar

from ninfer.engine.async_engine import AsyncEngine
from ninfer.engine.request import EngineRequest, GenerationEvent
from ninfer.errors import InvalidRequestError, NotFoundError

if TYPE_CHECKING:
    from ninfer.frontend.lifecycle import RequestObserver
    from ninfer.model.family import ModelFamily
    from ninfer.plugins import PluginRegistry
    from ninfer.profile.schema import Profile
    from ninfer.server.admission import AdmissionGate
    from ninfer.server.metrics import ServerMetrics
    from ninfer.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class ServerState:
    profile: Profile  # resolved
    registry: PluginRegistry
    engine: AsyncEngine
    tokenizer: Tokenizer
    family: Optional[ModelFamily]
    model_id: str
    max_model_len: int
    #: token ids a request may name (logit_bias, token-id prompts) are below this
    vocab_size: int
    gate: AdmissionGate
    extras: dict[str, Any] = field(default_factory=dict)  # per-protocol shared objects
    #: the LoRA adapters served beside the base model (``--lora-modules``), by name
    loras: tuple[str, ...] = ()
    #: told of every generation request's lifecycle: the request log, the metrics
    observers: tuple[RequestObserver, ...] = ()
    #: the Prometheus registry ``GET /metrics`` renders (None: no metrics route)
    metrics: Optional[ServerMetrics] = None
    #: the engine's KV pool in tokens, which one request alone must fit (None: the context's size)
    kv_capacity_tokens: Optional[int] = None

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every id a request's ``model`` may name: the base model's, then the adapters'."""
        return (self.model_id, *self.loras)

    def check_model(self, requested: str | None, required: bool = False) -> None:
        """An omitted or empty ``model`` means the base model (unless ``required``); any
        other name must be one this server serves: a 404 ``model_not_found`` otherwise."""
        if not requested:
            if required:
                raise InvalidRequestError("model is required", param="model")
            return
        if requested not in self.model_ids:
            adapters = f" (and the LoRA adapters {', '.join(map(repr, self.loras))})" if self.loras else ""
            raise NotFoundError(f"the model {requested!r} does not exist; this server serves {self.model_id!r}"
                                f"{adapters}", param="model", code="model_not_found")

    def lora_for(self, requested: str | None) -> str | None:
        """The adapter a request's ``model`` names, or None (the base model, or a name
        the protocol checks on its own)."""
        return requested if requested in self.loras else None

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
