"""What the OpenAPI document needs beyond Litestar's defaults: bodies, error bodies, event streams.

Litestar documents a handler's JSON result and its own validation-error shape; ninfer
answers errors in OpenAI's shape (:mod:`ninfer.server.errors`; a protocol may have its
own, such as Anthropic's) and, on request, with server-sent events, and its handlers
decode their bodies and query strings themselves (:mod:`ninfer.server.body`), which
Litestar cannot see. Routes declare all of it with :func:`documented` (and the older
:func:`body_operation` / :func:`event_stream_operation`), so the document says what is
actually sent and accepted; tests/test_openapi_fuzz.py holds the server to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Link, OpenAPIMediaType, OpenAPIResponse, Operation, Parameter, RequestBody

DONE = "[DONE]"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: Optional[str]
    code: str


class ErrorResponse(msgspec.Struct):
    """Every error ninfer's core and the OpenAI protocols answer with."""

    error: ErrorDetail


_WHY = {
    400: "The request is malformed or asks for something this server does not support; `param` names the field",
    401: "A valid API key is required (`Authorization: Bearer KEY` or `x-api-key: KEY`)",
    404: "The requested model (or stored object) does not exist on this server",
    408: "The request body did not arrive in time (--body-timeout-ms, --body-min-rate)",
    413: "The request body is larger than the server accepts",
    429: "Every running and waiting slot is taken; retry later",
    500: "The server failed while handling the request",
    503: "Not admitted within the pending timeout, the server is shutting down, or the engine is unavailable",
    504: "Not admitted within the pending timeout",
    529: "Every running and waiting slot is taken; retry later",
}
#: route-handler ``opt`` key naming the type of its errors, for those the server adds (the key's 401)
ERROR_SHAPE_OPT = "ninfer_error_shape"
#: what any route that reads a JSON body can answer: malformed, too slow, too large, a bug
BODY_ERRORS = (400, 408, 413, 500)
#: a generation's besides: unknown model, at capacity, not admitted / shutting down / engine failed
GENERATION_ERRORS = (*BODY_ERRORS, 404, 429, 503)


def json_response(container: Any, description: str) -> ResponseSpec:
    """A JSON response documented from its type (without Litestar's random examples)."""
    return ResponseSpec(data_container=container, description=description, generate_examples=False)


def error_responses(*statuses: int, container: Any = ErrorResponse,
                    why: Optional[dict[int, str]] = None) -> dict[int, ResponseSpec]:
    """The ``responses=`` entries for the error statuses a route can answer with, in the
    shape of ``container`` (OpenAI's by default)."""
    reasons = {**_WHY, **(why or {})}
    return {status: json_response(container, reasons[status]) for status in statuses}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``#/$defs/...`` references replaced by the definitions (no cycles)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {key: _inline(value, defs) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    return schema


def self_contained_schema(*types: Any) -> dict[str, Any]:
    """A JSON schema for any of ``types`` that needs no shared components."""
    schemas, defs = msgspec.json.schema_components(types)
    inlined = [_inline(schema, defs) for schema in schemas]
    return inlined[0] if len(inlined) == 1 else {"anyOf": inlined}


def require(schema: dict[str, Any], name: str, property_schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``name`` required and described by ``property_schema``: for a field the
    decoding type leaves optional so that its absence gets a 400 naming it."""
    required = [*schema.get("required", []), name]
    return {**schema, "properties": {**schema["properties"], name: property_schema},
            "required": sorted(set(required))}


def _json_body(kind: Any) -> RequestBody:
    # A plain JSON schema: Litestar writes dicts into the document as they are.
    schema = kind if isinstance(kind, dict) else self_contained_schema(kind)
    media = OpenAPIMediaType(schema=schema)  # type: ignore[arg-type]
    return RequestBody(content={"application/json": media}, required=True)


def body_operation(kind: Any) -> type[Operation]:
    """An ``operation_class`` documenting a JSON body of type ``kind`` that the handler decodes itself."""
    return documented(body=kind)


def _event_schema(payloads: tuple[Any, ...], done: Optional[str]) -> dict[str, Any]:
    """One server-sent event whose ``data`` is the JSON of one of ``payloads`` (or ``done``)."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": self_contained_schema(*payloads)}
    if done is not None:
        data = {"anyOf": [{"const": done}, data]}
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"}}}


def event_stream_operation(*payloads: Any, done: Optional[str] = DONE, body: Any = None) -> type[Operation]:
    """An ``operation_class`` whose 200 response may also be ``text/event-stream``.

    Each event's ``data`` is the JSON of one of ``payloads`` or the literal ``done``
    marker. OpenAPI 3.1 has no field for the items of a stream (3.2 adds
    ``itemSchema``); the media type's schema describes one event, which is how
    validators such as schemathesis read it. ``body``: the JSON body's type, as
    :func:`body_operation` documents it.
    """
    return documented(body=body, events=payloads, done=done)


def query(name: str, schema: dict[str, Any], description: str) -> Parameter:
    """An optional query parameter the handler reads from the raw query string itself."""
    return Parameter(name=name, param_in="query", schema=schema, description=description)  # type: ignore[arg-type]


def documented(*, body: Any = None, events: tuple[Any, ...] = (), done: Optional[str] = None,
               parameters: tuple[Parameter, ...] = (), success: bool = True,
               links: Optional[dict[str, Link]] = None) -> type[Operation]:
    """An ``operation_class`` adding what Litestar cannot see in the handler.

    ``body``: the JSON body's type (or a ready JSON schema); ``events``: the payload types
    of the ``text/event-stream`` form of the 200 answer (each event's ``data``, or the
    literal ``done``); ``parameters``: query parameters read by hand; ``success`` False
    for a route that never succeeds (its 2xx is dropped); ``links``: on the 200 answer,
    where its values can be used next.
    """
    request_body = _json_body(body) if body is not None else None
    stream = _event_schema(events, done) if events else None

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            if request_body is not None:
                self.request_body = request_body
            if parameters:
                self.parameters = [*(self.parameters or []), *parameters]
            responses = self.responses or {}
            if not success:
                for status in [s for s in responses if str(s).startswith("2")]:
                    del responses[status]
            ok = responses.get("200")
            if isinstance(ok, OpenAPIResponse):
                if stream is not None:
                    # A plain JSON schema: Litestar writes dicts into the document as they are.
                    events = OpenAPIMediaType(schema=stream)  # type: ignore[arg-type]
                    ok.content = {**(ok.content or {}), "text/event-stream": events}
                if links:
                    ok.links = links

    return DocumentedOperation
