"""Generation capacity in front of the engine: 429 when full, 503 when the wait runs out.

Capacity is ``max_concurrency + max_pending_requests`` requests. One HTTP request holds
one slot from the moment it claims one (:meth:`AdmissionGate.reserve`, or implicitly
its first :meth:`AdmissionGate.generate`) until its response has been sent: the request
middleware releases it then. The pending deadline runs from the request's arrival, so
it covers preparation (tokenizing, media) and the engine's FIFO wait; the engine's
admission event ends the wait.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from ninfer.engine.request import EngineRequest, GenerationEvent
from ninfer.errors import RequestQueueTimeoutError, ServerOverloadedError, ServerShuttingDownError

if TYPE_CHECKING:
    from ninfer.engine.async_engine import AsyncEngine


#: what a request still running when the drain bound passes fails with
SHUT_DOWN_MESSAGE = "the server shut down before the request finished"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


@dataclass(eq=False)
class Ticket:
    """One HTTP request: its id, arrival time, capacity slot, and token counts and error for the log."""

    request_id: str = field(default_factory=new_request_id)
    started: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    generated: bool = False
    #: which checkpoint the (first) prompt's prefix hit came from (ninfer.engine.context_cache.PATHS)
    reuse_path: Optional[str] = None
    #: the client hung up before the response was complete (the work was cancelled)
    disconnected: bool = False
    #: the machine-readable code of the error the request ended with (see ninfer.server.errors)
    error_code: Optional[str] = None
    #: the ASGI scope of the HTTP request (the request log reads its route and protocol)
    scope: Optional[dict] = None
    _gate: Optional[AdmissionGate] = None  # set while the ticket holds a slot
    #: run once when the request ends (see :meth:`on_release`)
    _on_release: list[Callable[[], None]] = field(default_factory=list)

    @property
    def holds_slot(self) -> bool:
        return self._gate is not None

    def on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the request ends (the middleware releases every ticket then):
        the pipeline settles a run whose events were never read this way."""
        self._on_release.append(fn)

    def release(self) -> None:
        """Give the slot back and run the end-of-request callbacks (idempotent)."""
        if self._gate is not None:
            self._gate.in_flight -= 1
            self._gate = None
        callbacks, self._on_release = self._on_release, []
        for fn in callbacks:
            fn()

    def count(self, last: GenerationEvent) -> None:
        self.generated = True
        self.prompt_tokens += last.num_prompt_tokens
        self.cached_tokens += last.num_cached_tokens
        if self.reuse_path is None:
            self.reuse_path = last.timings.reuse_path
        self.completion_tokens += last.num_output_tokens


_current: ContextVar[Optional[Ticket]] = ContextVar("ninfer_ticket", default=None)


def current_ticket() -> Optional[Ticket]:
    """The ticket of the HTTP request being handled, if any."""
    return _current.get()


def request_id() -> str:
    """The HTTP request's id (also in ``x-request-id``), or a fresh one outside a request."""
    ticket = current_ticket()
    return ticket.request_id if ticket is not None else new_request_id()


def set_current_ticket(ticket: Optional[Ticket]):
    """Bind ``ticket`` to the running context; returns the token for ``reset_current_ticket``."""
    return _current.set(ticket)


def reset_current_ticket(token) -> None:
    _current.reset(token)


class AdmissionGate:
    def __init__(self, capacity: int, pending_timeout_s: float):
        self.capacity = capacity
        self.pending_timeout_s = pending_timeout_s
        self.in_flight = 0
        #: set when the server drains before exit: no new slots, /health answers 503
        self.draining = False
        #: set when the drain bound has passed: the engine's requests are failed
        #: (:meth:`ninfer.engine.async_engine.AsyncEngine.fail_all`) and none starts any more
        self.cut = False

    def reserve(self, ticket: Optional[Ticket] = None) -> Ticket:
        """Count ``ticket`` (default: the current request's) against capacity from now on.

        Protocols may call this when preparation starts; :meth:`generate` does it
        otherwise. Holding a slot already is fine. Raises 503 while draining and 429 when
        every slot is taken.
        """
        ticket = ticket or current_ticket() or Ticket()
        if ticket.holds_slot:
            return ticket
        if self.draining:
            raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
        if self.in_flight >= self.capacity:
            raise ServerOverloadedError(
                f"the server is at capacity ({self.capacity} requests running or waiting); retry later"
            )
        self.in_flight += 1
        ticket._gate = self
        return ticket

    async def generate(self, engine: AsyncEngine, request: EngineRequest) -> AsyncIterator[GenerationEvent]:
        """The engine's events for ``request`` once capacity and the deadline allow.

        The first event is the engine's admission (or a failure ending the request).
        Closing the iterator aborts the engine request. Outside an HTTP request (no
        current ticket) the slot is held only while iterating.
        """
        ticket = current_ticket()
        own = ticket is None
        ticket = self.reserve(ticket or Ticket(request.request_id))
        last: Optional[GenerationEvent] = None
        try:
            if self.cut:
                raise ServerShuttingDownError(SHUT_DOWN_MESSAGE)
            remaining = ticket.started + self.pending_timeout_s - time.monotonic()
            if remaining <= 0:
                raise self._timeout()
            async with aclosing(engine.generate(request)) as events:
                try:
                    # Cancelling the wait throws into the engine stream, which aborts the request.
                    last = await asyncio.wait_for(anext(events), remaining)
                except asyncio.TimeoutError:
                    raise self._timeout() from None
                yield last
                async for last in events:
                    yield last
        finally:
            if last is not None:
                ticket.count(last)
            if own:
                ticket.release()

    def _timeout(self) -> RequestQueueTimeoutError:
        ms = round(self.pending_timeout_s * 1000)
        return RequestQueueTimeoutError(f"the request was not admitted within the pending timeout ({ms} ms)")
