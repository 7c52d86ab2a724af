"""Slow and idle clients: read deadlines for headers and bodies, and a cap on open connections.

uvicorn's h11 protocol bounds a header's size (``h11_max_incomplete_event_size``, 16 KiB:
a larger one is a plain-text 400) and the idle time between two requests on a kept-alive
connection (``timeout_keep_alive``), but nothing else: a new connection that never sends a
byte, headers trickling in for ever and a body sent at 1 byte/s all stay open for as long
as the client likes, each holding a file descriptor. :class:`GuardedH11Protocol` adds

- a header deadline: the request line and headers must arrive within ``header_timeout_s``
  of the connection opening (or of the previous response ending). Missing it closes the
  connection, after a raw 408 if part of a request had arrived;
- a body deadline in Apache's ``mod_reqtimeout`` form: ``body_timeout_s`` from the end of
  the headers plus one second per ``body_min_rate`` bytes received. Missing it makes the
  handler's next read raise :class:`ninfer.errors.RequestTimeoutError` (see
  :func:`guarded_receive`), so the 408 comes in the route's own error shape, and the
  connection closes after it. Time the server itself stops reading (the handler is not
  consuming the body) is not held against the client. When the server stops, a body
  still arriving is cut the same way with a 503 ``server_shutting_down``;
- a cap of ``max_connections`` open connections. A connection over the cap first evicts
  the connection that has waited longest for its next request (an idle keep-alive, a
  silent or slow-header client); when every connection is busy with a request, the new
  one is answered 503 ``too_many_connections`` and closed (:data:`OVER_CAPACITY`).

Only connections waiting on their client are checked, once per :data:`TICK_S`; a request
being answered (a long stream included) is never timed out here.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ninfer.errors import RequestTimeoutError, ServerShuttingDownError
from ninfer.server.admission import new_request_id
from ninfer.server.errors import error_body, send_json

TICK_S = 0.5
#: scope key set when the body will not be read to its end: the next receive() raises
#: (the value says why: :data:`TIMED_OUT` or :data:`SHUTTING_DOWN`)
BODY_TIMEOUT_KEY = "ninfer.body_interrupted"
TIMED_OUT, SHUTTING_DOWN = "timed_out", "shutting_down"
#: key in the ASGI scope's ``state`` of a request on a connection over the cap
OVER_CAPACITY = "ninfer.over_capacity"
#: after a body timeout, how long the route has to answer its 408 before the connection closes anyway
ANSWER_GRACE_S = 2.0
_HEADER_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_HEADER_TIMEOUT_BODY = (b'{"error": {"message": "the request headers did not arrive in time", '
                        b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')


@attrs.frozen
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    #: bytes per second of body that extend the body deadline by one second (0: no extension)
    body_min_rate: int = 1024
    max_connections: int = 1024


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``) for ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def guarded_receive(scope: Any, receive: Any) -> Any:
    """``receive`` that raises an interrupted body's error into the handler reading it."""

    async def checked() -> Any:
        message = await receive()
        why = scope.get(BODY_TIMEOUT_KEY)
        if why and message["type"] == "http.request":
            if why == SHUTTING_DOWN:
                raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
            raise RequestTimeoutError("the request body did not arrive in time")
        return message

    return checked


class GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: Optional[Any] = None
        self._phase: Optional[str] = None
        self._since = self.loop.time()
        self._received = 0  # bytes of the current phase (partial headers, or body)
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            # Answered once its request line is read (still under the header deadline).
            self.app_state = {**self.app_state, OVER_CAPACITY: True}
        self._check()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        super().data_received(data)
        self._check()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._check()

    def shutdown(self) -> None:
        """uvicorn's server is stopping: a body still arriving will not be waited for (the
        handler answers 503 in its route's shape), the rest as uvicorn does it."""
        if not self.interrupt_body(SHUTTING_DOWN):
            super().shutdown()

    # -- deadlines ---------------------------------------------------------------
    def waiting_for(self) -> Optional[str]:
        """What this connection waits for from its client: "headers", "body" or None."""
        if self.transport is None or self.transport.is_closing():
            return None
        if self.conn.their_state is h11.SEND_BODY:
            return "body"
        cycle = self.cycle
        if (cycle is None or cycle.response_complete) and self.conn.their_state is h11.IDLE:
            return "headers"
        return None

    @property
    def busy(self) -> bool:
        """A request is being answered (the client may be reading a long stream)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _check(self) -> None:
        """Note phase changes, enforce the deadline of the current phase, re-arm the tick."""
        phase = self.waiting_for()
        now = self.loop.time()
        if phase != self._phase:
            self._phase, self._since = phase, now
            self._received = 0
        if phase == "body" and self.flow.read_paused:
            self._since, self._received = now, 0  # the server is not reading: not the client's fault
        if phase == "headers" and now - self._since >= self.limits.header_timeout_s:
            self._header_timeout()
            return
        if phase == "body" and now >= self._body_deadline():
            if not self.interrupt_body(TIMED_OUT):
                self.transport.close()  # answered already: only the connection is left to end
            return
        self._cancel_timer()
        if phase is not None:
            self._timer = self.loop.call_later(TICK_S, self._check)

    def _body_deadline(self) -> float:
        rate = self.limits.body_min_rate
        return self._since + self.limits.body_timeout_s + (self._received / rate if rate > 0 else 0.0)

    def _header_timeout(self) -> None:
        self._cancel_timer()
        if self._received:  # part of a request arrived: say why it is closed
            self.transport.write(_HEADER_TIMEOUT_RESPONSE % (len(_HEADER_TIMEOUT_BODY), _HEADER_TIMEOUT_BODY))
        self.transport.close()

    def interrupt_body(self, why: str) -> bool:
        """Stop reading a request body still arriving: the handler's next read raises (see
        :func:`guarded_receive`), its error answer goes out, then the connection closes.
        False when no request is waiting for its body with its answer not yet started."""
        cycle = self.cycle
        if self.waiting_for() != "body" or cycle is None or cycle.response_started:
            return False
        self._cancel_timer()
        self.flow.pause_reading()  # no more of this body
        cycle.scope[BODY_TIMEOUT_KEY] = why  # type: ignore[literal-required]
        cycle.keep_alive = False
        cycle.message_event.set()  # wake a handler waiting for the next chunk
        self._timer = self.loop.call_later(ANSWER_GRACE_S, self.transport.close)
        return True

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the cap -------------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Close the connection waiting longest for its next request; False if none is."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedH11Protocol) and c.waiting_for() == "headers"]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._since)
        oldest._cancel_timer()
        oldest.transport.close()
        return True


def busy(connections: Any) -> set[GuardedH11Protocol]:
    """Those of ``connections`` still answering a request."""
    return {c for c in list(connections) if isinstance(c, GuardedH11Protocol) and c.busy}


def end_busy(connections: Any) -> int:
    """The drain's last resort for connections still busy with a request: a body still
    arriving is answered 503 (:meth:`GuardedH11Protocol.interrupt_body`), any other
    connection (a client not reading its answer) is closed. Returns how many."""
    stuck = busy(connections)
    for connection in stuck:
        if not connection.interrupt_body(SHUTTING_DOWN):
            connection.transport.close()
    return len(stuck)


async def refuse_connection(send: Any) -> None:
    """The answer to a request on a connection over the cap (:data:`OVER_CAPACITY`)."""
    body = error_body(503, "the server has too many open connections; retry shortly", "too_many_connections")
    await send_json(send, 503, body, [(b"retry-after", b"1"), (b"connection", b"close"),
                                      (b"x-request-id", new_request_id().encode())])


def connection_counts(connections: Any) -> tuple[int, int]:
    """(open, busy) connections."""
    return len(connections), len(busy(connections))


#: descriptors the process needs besides its connections (model files, logs, threads' pipes)
FD_HEADROOM = 128


def ensure_fd_limit(max_connections: int) -> Optional[str]:
    """Raise the soft descriptor limit to fit ``max_connections``; a warning when it cannot."""
    try:
        import resource
    except ImportError:  # not POSIX: the system's limit stands
        return None
    want = max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < want:
        return (f"the process may open only {target} files, fewer than --max-connections {max_connections} "
                f"needs (+{FD_HEADROOM}); raise `ulimit -n` or lower --max-connections")
    return None
