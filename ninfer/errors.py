"""Typed errors the engine raises and the protocol adapters map to HTTP statuses."""

from __future__ import annotations


class NinferError(Exception):
    """Base class. ``code`` is the machine-readable error code, ``param`` the field."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequestError(NinferError):
    """The request itself is wrong; the client must change it (HTTP 400)."""

    status = 400
    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class EngineDeadError(NinferError):
    """The engine failed as a whole and accepts no more work (HTTP 503)."""

    status = 503
    code = "engine_unavailable"


class RequestAbortedError(NinferError):
    status = 499
    code = "request_cancelled"


class RequestTimeoutError(NinferError):
    """The client sent its request body too slowly (HTTP 408; see ninfer.server.connections)."""

    status = 408
    code = "request_timeout"


class AuthenticationError(NinferError):
    status = 401
    code = "invalid_api_key"


class NotFoundError(NinferError):
    status = 404
    code = "not_found"


class RequestTooLargeError(NinferError):
    status = 413
    code = "request_too_large"


class ServerOverloadedError(NinferError):
    """Active plus pending requests are at capacity (HTTP 429)."""

    status = 429
    code = "server_overloaded"


class RequestQueueTimeoutError(NinferError):
    """Not admitted before --pending-timeout-ms ran out (HTTP 503)."""

    status = 503
    code = "request_queue_timeout"


class UnsupportedFeatureError(InvalidRequestError):
    """A field asks for behaviour ninfer cannot provide; named so the client can drop it."""

    code = "unsupported_parameter"


class ModelLoadingError(NinferError):
    """The server is up but the model has not finished loading (HTTP 503)."""

    status = 503
    code = "model_loading"


class ServerShuttingDownError(NinferError):
    """The server is draining before exit and takes no new generations (HTTP 503)."""

    status = 503
    code = "server_shutting_down"


def type_field(obj, where: str, default=None):
    """``obj["type"]`` (``default`` when absent) of a client's JSON object, refused unless it
    is a string: it is looked up in tables next, and a list or object there would be a
    server error instead of the client's."""
    kind = obj.get("type", default)
    if kind is not None and not isinstance(kind, str):
        raise InvalidRequestError("type must be a string", param=f"{where}.type")
    return kind
