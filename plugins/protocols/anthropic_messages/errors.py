"""Errors in Anthropic's shape, with the request id in the body and a ``request-id`` header.

The server core answers in OpenAI's shape; these handlers are registered on the
Messages routes, so Litestar prefers them there. Statuses follow Anthropic's contract:
an overloaded server answers 529 (the core's 429) and a request that waited too long
for admission or media answers 504 (the core's 503 timeout).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from loguru import logger

from ninfer.errors import NinferError, RequestQueueTimeoutError, RequestTimeoutError, ServerOverloadedError
from ninfer.server.admission import request_id
from ninfer.server.errors import INTERNAL_MESSAGE, MIB

REQUEST_ID_HEADER = "request-id"
OVERLOADED = 529
GATEWAY_TIMEOUT = 504

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    408: "timeout_error",
    429: "rate_limit_error",
    GATEWAY_TIMEOUT: "timeout_error",
    OVERLOADED: "overloaded_error",
}



def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def status_of(exc: NinferError) -> int:
    """Anthropic's status for a typed error (most keep the core's)."""
    if isinstance(exc, ServerOverloadedError):
        return OVERLOADED
    if isinstance(exc, RequestTimeoutError):  # the client's own slow body: not a wait of ours
        return exc.status
    if isinstance(exc, RequestQueueTimeoutError) or exc.code.endswith("_timeout"):  # queue or media wait
        return GATEWAY_TIMEOUT
    return exc.status


def _message(message: str, param: str | None) -> str:
    """Anthropic errors have no field slot, so the field leads the message."""
    return f"{param}: {message}" if param and not message.startswith(param) else message


def error_body(status: int, message: str, rid: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": _message(message, param)},
            "request_id": rid}


def ninfer_error_body(exc: NinferError, rid: str) -> tuple[int, dict[str, Any]]:
    status = status_of(exc)
    return status, error_body(status, exc.message, rid, exc.param)


def error_view(exc: BaseException) -> dict[str, Any]:
    """What a client of these routes gets for ``exc``, for the request log (``ERROR_VIEW_OPT``)."""
    if not isinstance(exc, NinferError):
        return {"status": 500, "type": error_type(500), "code": "internal_error", "param": None,
                "message": INTERNAL_MESSAGE}
    status = status_of(exc)
    return {"status": status, "type": error_type(status), "code": exc.code, "param": exc.param,
            "message": _message(exc.message, exc.param)}


def error_frame(rid: str, exc: NinferError) -> bytes:
    """A failure after the stream has started, as Anthropic's ``error`` event."""
    _, body = ninfer_error_body(exc, rid)
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"


def _respond(status: int, body: dict[str, Any], headers: Any = None) -> Response:
    return Response(body, status_code=status, headers={**(headers or {}), REQUEST_ID_HEADER: body["request_id"]})


def handle_ninfer_error(_: Request, exc: NinferError) -> Response:
    status, body = ninfer_error_body(exc, request_id())
    return _respond(status, body)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status, rid = exc.status_code, request_id()
    if status >= 500:
        return _respond(status, error_body(status, INTERNAL_MESSAGE, rid))
    message = str(exc.detail)
    handler = request.scope.get("route_handler")
    if status == 413 and handler is not None and handler.resolve_request_max_body_size():
        message = f"the request body is larger than the server accepts " \
                  f"({handler.resolve_request_max_body_size() / MIB:g} MiB)"
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        message = f"{message}: {exc.extra[0]}"
    return _respond(status, error_body(status, message, rid), exc.headers)


def handle_decode_error(_: Request, exc: msgspec.MsgspecError) -> Response:
    """The body is not JSON, or a field has the wrong type (msgspec names where)."""
    return _respond(400, error_body(400, f"invalid request body: {exc}", request_id()))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.opt(exception=exc).error("unhandled {} in {} {}", type(exc).__name__, request.method, request.url.path)
    return _respond(500, error_body(500, INTERNAL_MESSAGE, request_id()))


EXCEPTION_HANDLERS = {
    NinferError: handle_ninfer_error,
    HTTPException: handle_http_exception,
    msgspec.DecodeError: handle_decode_error,
    msgspec.ValidationError: handle_decode_error,
    Exception: handle_unexpected,
}
