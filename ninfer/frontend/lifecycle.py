"""A served generation request as measurement sees it: rejected, or started and then ended once.

Every protocol's generation goes through :meth:`ninfer.frontend.pipeline.Pipeline.prepare`
and :meth:`ninfer.frontend.pipeline.Run.events`, so the lifecycle is reported from there
and nowhere else: a preparation failure (admission refusal included) is one
:meth:`RequestObserver.rejected`; a prepared request is one
:meth:`RequestObserver.started` followed by exactly one :meth:`RequestObserver.ended`,
whether the engine produced an outcome, failed, or the client went away. The ended
call happens when the event stream ends, or, for a run whose events were never read
(a response that failed before generating), when the HTTP request ends.

Observers (the JSONL request log, the Prometheus metrics) run on the event loop and
must be quick; one that raises is logged and never fails the request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import attrs
from loguru import logger

if TYPE_CHECKING:
    from ninfer.frontend.pipeline import Run
    from ninfer.frontend.pipeline_request import GenerateRequest
    from ninfer.server.admission import Ticket


class RequestObserver(Protocol):
    def rejected(self, rejection: Rejection) -> None: ...

    def started(self, run: Run) -> None: ...

    def ended(self, run: Run) -> None: ...


@attrs.frozen
class Rejection:
    """A generation request refused before it started: at admission (429/503) or in preparation."""

    request_id: str
    #: the HTTP request's ticket (its protocol and path), None outside HTTP
    ticket: Optional[Ticket]
    #: "admission" (capacity, draining) or "prepare" (lowering, rendering, checks)
    phase: str
    error: Exception
    #: what the protocol lowered, when lowering got that far
    request: Optional[GenerateRequest]
    stream: bool
    prepare_seconds: float


@attrs.define
class Lifecycle:
    """What a :class:`Run` carries for its observers beside its choices."""

    observers: Sequence[RequestObserver]
    ticket: Optional[Ticket]
    request: GenerateRequest
    stream: bool
    #: monotonic seconds: when the HTTP request arrived (preparation's start outside HTTP)
    arrived: float
    prepare_seconds: float
    ended_at: Optional[float] = None
    #: why the run ended without an outcome (None with an outcome, or not ended yet)
    failure: Optional[BaseException] = None
    ended: bool = False


def notify(observers: Sequence[RequestObserver], method: str, *args: Any) -> None:
    for observer in observers:
        try:
            getattr(observer, method)(*args)
        except Exception:  # measurement must never fail a request
            logger.opt(exception=True).warning("a request observer failed in {}", method)


def end_run(run: Run, failure: Optional[BaseException]) -> None:
    """Report ``run``'s one terminal (later calls do nothing).

    With every choice finished the engine returned its outcome (a failure raised after
    that, while rendering or sending, does not change it); otherwise ``failure`` is why
    it ended without one (None: the response ended before generation was read).
    """
    life = run.life
    if life is None or life.ended:
        return
    life.ended, life.ended_at = True, time.monotonic()
    life.failure = None if run.finished else failure
    notify(life.observers, "ended", run)


def failure_kind(failure: Optional[BaseException]) -> str:
    """How a run without an outcome ended: error, cancelled or not_generated."""
    if failure is None:
        return "not_generated"
    if isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "error"

