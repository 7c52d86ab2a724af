"""Error bodies in OpenAI's shape, and the exception handlers every route starts with.

Typed :class:`ninfer.errors.NinferError` subclasses carry their own HTTP status, code and
parameter. Litestar's own exceptions (unknown route, wrong method, unreadable or
oversized body, schema validation) are client mistakes and keep their 4xx status.
Anything else is a bug: the client gets a 500 with a fixed message and the traceback
goes to the log (never the request body). A protocol that needs another error shape
(Anthropic's, say) registers its own handlers on its routes; Litestar picks the
handler closest to the route.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import Send
from loguru import logger

from ninfer.errors import AuthenticationError, NinferError
from ninfer.server.retry_after import HEADER as RETRY_AFTER, retry_after

#: HTTP status -> machine-readable code for Litestar's own exceptions
_HTTP_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}
INTERNAL_MESSAGE = "the server failed while handling the request"
MIB = 1 << 20


def error_type(status: int) -> str:
    """OpenAI's coarse error category for an HTTP status."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def ninfer_error_body(exc: NinferError) -> dict[str, Any]:
    return error_body(exc.status, exc.message, exc.code, exc.param)


def handle_ninfer_error(_: Request, exc: NinferError) -> Response:
    headers = {"www-authenticate": "Bearer"} if isinstance(exc, AuthenticationError) else None
    return Response(ninfer_error_body(exc), status_code=exc.status, headers=headers)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status >= 500:  # e.g. a client that vanished mid-upload; the detail is ours, not theirs
        return Response(error_body(status, INTERNAL_MESSAGE, "internal_error"), status_code=status)
    message, param = exc.detail, None
    handler = request.scope.get("route_handler")
    if status == 413 and handler is not None and handler.resolve_request_max_body_size():
        limit = handler.resolve_request_max_body_size() / MIB
        message = f"the request body is larger than the server accepts ({limit:g} MiB)"
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0]
        if isinstance(first, Mapping):
            detail = str(first.get("message", ""))
            key = first.get("key")
            param = _field(None if key == "data" else key, detail)  # "data" is the whole body
            message = f"{exc.detail}: {detail}".rstrip(": ")
    code = _HTTP_CODES.get(status, f"http_{status}")
    return Response(error_body(status, message, code, param), status_code=status, headers=exc.headers)


def handle_decode_error(_: Request, exc: msgspec.MsgspecError) -> Response:
    """A protocol decoding the body itself with msgspec: the body is malformed."""
    message = str(exc)
    at = _AT.search(message)
    return Response(error_body(400, message, "invalid_request", _field(at and at.group(1), message)),
                    status_code=400)


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"required field `([^`]+)`")


def _field(path: str | None, message: str) -> str | None:
    """The offending field of a msgspec error: its location, plus a missing field's name."""
    missing = _MISSING.search(message)
    if missing is None:
        return path or None
    return f"{path}.{missing.group(1)}" if path else missing.group(1)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.opt(exception=exc).error("unhandled {} in {} {}", type(exc).__name__, request.method, request.url.path)
    return Response(error_body(500, INTERNAL_MESSAGE, "internal_error"), status_code=500)


def error_code(exc: Exception) -> str:
    """The machine-readable code the handlers above answer ``exc`` with (for the request log)."""
    if isinstance(exc, NinferError):
        return exc.code
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        return "invalid_request"
    return "internal_error"


EXCEPTION_HANDLERS = {
    NinferError: handle_ninfer_error,
    HTTPException: handle_http_exception,
    msgspec.DecodeError: handle_decode_error,
    msgspec.ValidationError: handle_decode_error,
    Exception: handle_unexpected,
}


async def send_json(send: Send, status: int, body: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON response over raw ASGI, for answers given before Litestar routes."""
    payload = msgspec.json.encode(body)
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*start_headers, *headers]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def send_error(send: Send, exc: NinferError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    seconds = retry_after(exc.status, exc.code)
    if seconds is not None:
        headers = [*headers, (RETRY_AFTER.encode(), str(seconds).encode())]
    await send_json(send, exc.status, ninfer_error_body(exc), headers)
