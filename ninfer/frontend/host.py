"""What the pipeline reads of its owner: the server's state, or ``LLM`` without a server.

Two small protocols instead of one class, because ``LLM`` and the batch runner only
plan requests (they run the engine loop themselves), while the server also admits them,
works off its event loop and streams the engine's events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from ninfer.engine.request import EngineRequest, GenerationEvent
    from ninfer.frontend.lifecycle import RequestObserver
    from ninfer.model.family import ModelFamily
    from ninfer.plugins import PluginRegistry
    from ninfer.profile.schema import Profile
    from ninfer.server.admission import AdmissionGate
    from ninfer.tokenizer import Tokenizer

T = TypeVar("T")


class ModelHost(Protocol):
    """What planning a request needs (:meth:`ninfer.frontend.pipeline.Pipeline.plan`)."""

    @property
    def profile(self) -> Profile: ...

    @property
    def registry(self) -> PluginRegistry: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def family(self) -> Optional[ModelFamily]: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> Optional[int]:
        """The KV pool's size in tokens, which one request alone must fit (None: no smaller than the context)."""
        ...


class ServingHost(ModelHost, Protocol):
    """What serving adds (:meth:`ninfer.frontend.pipeline.Pipeline.prepare`):
    :class:`ninfer.server.state.ServerState` is the one implementation."""

    @property
    def gate(self) -> AdmissionGate: ...

    @property
    def observers(self) -> Sequence[RequestObserver]:
        """Told of each generation request's rejection, start and end (:mod:`ninfer.frontend.lifecycle`)."""
        ...

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[GenerationEvent]: ...
