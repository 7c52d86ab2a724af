"""The outermost layer of every request (id, Retry-After, slot release, request log) and the API-key guard.

The middleware wraps Litestar's whole ASGI handler (not a per-route middleware), so
unknown paths, CORS preflights and errors raised while routing get an ``x-request-id``
too. The key is checked by a guard instead, after routing: its 401 is then rendered by
the matched route's exception handlers, in that route's protocol's error shape.
Which error a request ended with is recorded on its ticket by :func:`record_error`
(an app-wide exception hook, so it sees every protocol's errors), which lets this layer
add ``Retry-After`` to refusals and the error code to the request log.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp, Guard, Message, Receive, Scope, Send
from loguru import logger

from ninfer.errors import AuthenticationError
from ninfer.server.admission import Ticket, reset_current_ticket, set_current_ticket
from ninfer.server.errors import error_code
from ninfer.server.retry_after import HEADER as RETRY_AFTER, retry_after

REQUEST_ID_HEADER = b"x-request-id"
RETRY_AFTER_HEADER = RETRY_AFTER.encode()
#: scope key holding the request's :class:`Ticket`
TICKET_KEY = "ninfer.ticket"
#: route-handler ``opt`` key naming the protocol plugin that contributed the route
PROTOCOL_OPT = "ninfer_protocol"
#: the protocol name of the server's own routes (/health, /v1/models, ...)
CORE_PROTOCOL = "core"
#: route-handler ``opt`` key of a protocol that answers errors its own way (as its route's
#: exception handlers do): ``view(exc) -> {"status", "type", "code", "param", "message"}``,
#: what its client gets for ``exc``, which the request log records. Absent: the core's answer.
ERROR_VIEW_OPT = "ninfer_error_view"
#: (method, path) of the routes reachable without the API key: readiness, and the
#: ``HEAD /`` reachability probe clients (Claude Code) send before their key. ``GET /``
#: names the server and model, so it needs the key like everything else.
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/")})


def is_open(method: str, paths: set[str] | frozenset[str]) -> bool:
    """Whether ``method`` on a handler serving ``paths`` needs no API key."""
    return bool(paths) and all((method, path) in OPEN_ROUTES for path in paths)


def is_preflight(scope: Scope) -> bool:
    """A CORS preflight: an OPTIONS naming the origin and the method it asks about."""
    if scope["method"] != "OPTIONS":
        return False
    names = {name for name, _ in scope["headers"]}
    return b"origin" in names and b"access-control-request-method" in names


def request_id(connection: ASGIConnection | Scope) -> str:
    """The id sent back in ``x-request-id`` for this request (also fine for logs)."""
    scope = connection.scope if isinstance(connection, ASGIConnection) else connection
    return scope[TICKET_KEY].request_id


class RequestMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ticket = Ticket(scope=scope)  # type: ignore[arg-type]  # the request log reads its route
        scope[TICKET_KEY] = ticket  # type: ignore[literal-required]
        status = 0
        rid = (REQUEST_ID_HEADER, ticket.request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                names = {name.lower() for name, _ in headers}
                if REQUEST_ID_HEADER not in names:
                    headers.append(rid)
                seconds = retry_after(status, ticket.error_code)
                if seconds is not None and RETRY_AFTER_HEADER not in names:
                    headers.append((RETRY_AFTER_HEADER, str(seconds).encode()))
                message = {**message, "headers": headers}  # type: ignore[assignment]
            await send(message)

        token = set_current_ticket(ticket)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            reset_current_ticket(token)
            ticket.release()
            _log_request(scope, ticket, status)


async def record_error(exc: Exception, scope: Scope) -> None:
    """Litestar's ``after_exception`` hook: note the error's code on the request's ticket.

    It runs before the route's own handler renders the error, whatever its protocol.
    """
    ticket = scope.get(TICKET_KEY)  # type: ignore[call-overload]
    if ticket is not None:
        ticket.error_code = error_code(exc)


def api_key_guard(api_key: str) -> Guard:
    """A guard admitting requests that carry ``api_key`` as a Bearer token or in ``x-api-key``.

    Only :data:`OPEN_ROUTES` and CORS preflights pass without it (with ``--cors`` Litestar
    answers preflights before routing; without it they reach the route's OPTIONS handler,
    which only lists methods). A plain OPTIONS needs the key: its ``Allow`` header maps
    the API.
    """
    expected = api_key.encode()

    async def require_api_key(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        scope = connection.scope
        if is_open(scope["method"], handler.paths) or is_preflight(scope):
            return
        if not _carries_key(connection.scope["headers"], expected):
            raise AuthenticationError("a valid API key is required")

    return require_api_key


def _carries_key(headers: list[tuple[bytes, bytes]], expected: bytes) -> bool:
    for name, value in headers:  # constant-time comparisons: no timing hints about the key
        if name == b"authorization":
            scheme, _, credential = value.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), expected):
                return True
        elif name == b"x-api-key" and hmac.compare_digest(value.strip(), expected):
            return True
    return False


def _log_request(scope: Scope, ticket: Ticket, status: int) -> None:
    """One line per request: protocol routes at INFO, the server's own routes at DEBUG.

    Only the method, path, status, error code, token counts and time: never bodies,
    headers or error messages (which may quote the request).
    """
    handler: Any = scope.get("route_handler")
    protocol = handler.opt.get(PROTOCOL_OPT, CORE_PROTOCOL) if handler is not None else CORE_PROTOCOL
    line = f"{ticket.request_id} {protocol} {scope['method']} {scope['path']} {status or 'no response'}"
    if ticket.error_code is not None:
        line += f", error {ticket.error_code}"
    if ticket.generated:
        share = 100 * ticket.cached_tokens / ticket.prompt_tokens if ticket.prompt_tokens else 0.0
        path = (ticket.reuse_path or "root").replace("_", " ")
        line += (f", prompt {ticket.prompt_tokens}, cache {ticket.cached_tokens} ({share:.0f}%, {path}), "
                 f"completion {ticket.completion_tokens} tokens")
    line += f", {time.monotonic() - ticket.started:.2f} s"
    if ticket.disconnected:
        line += ", cancelled: client disconnected"
    logger.log("DEBUG" if protocol == CORE_PROTOCOL else "INFO", line)
