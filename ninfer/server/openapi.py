"""What the OpenAPI document needs beyond Litestar's defaults: bodies, error bodies, event streams.

Litestar documents a handler's JSON result and its own validation-error shape; ninfer
answers errors in OpenAI's shape (:mod:`ninfer.server.errors`) and, on request, with
server-sent events, and its handlers decode their bodies themselves
(:mod:`ninfer.server.body`), which Litestar cannot see. Routes declare all three with
the helpers here, so the document says what is actually sent and accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, RequestBody

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
    404: "The requested model does not exist on this server",
    413: "The request body is larger than the server accepts",
    429: "Every running and waiting slot is taken; retry later",
    500: "The server failed while handling the request",
    503: "Not admitted within the pending timeout, the server is shutting down, or the engine is unavailable",
}


def json_response(container: Any, description: str) -> ResponseSpec:
    """A JSON response documented from its type (without Litestar's random examples)."""
    return ResponseSpec(data_container=container, description=description, generate_examples=False)


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """The ``responses=`` entries for the OpenAI-shaped error statuses a route can answer with."""
    return {status: json_response(ErrorResponse, _WHY[status]) for status in statuses}


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


def _json_body(kind: Any) -> RequestBody:
    # A plain JSON schema: Litestar writes dicts into the document as they are.
    media = OpenAPIMediaType(schema=self_contained_schema(kind))  # type: ignore[arg-type]
    return RequestBody(content={"application/json": media}, required=True)


def body_operation(kind: Any) -> type[Operation]:
    """An ``operation_class`` documenting a JSON body of type ``kind`` that the handler decodes itself."""
    body = _json_body(kind)

    @dataclass
    class BodyOperation(Operation):
        def __post_init__(self) -> None:
            self.request_body = body

    return BodyOperation


def event_stream_operation(*payloads: Any, done: Optional[str] = DONE, body: Any = None) -> type[Operation]:
    """An ``operation_class`` whose 200 response may also be ``text/event-stream``.

    Each event's ``data`` is the JSON of one of ``payloads`` or the literal ``done``
    marker. OpenAPI 3.1 has no field for the items of a stream (3.2 adds
    ``itemSchema``); the media type's schema describes one event, which is how
    validators such as schemathesis read it. ``body``: the JSON body's type, as
    :func:`body_operation` documents it.
    """
    request_body = _json_body(body) if body is not None else None
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": self_contained_schema(*payloads)}
    if done is not None:
        data = {"anyOf": [{"const": done}, data]}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"}}}

    @dataclass
    class EventStreamOperation(Operation):
        def __post_init__(self) -> None:
            if request_body is not None:
                self.request_body = request_body
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse):
                # A plain JSON schema: Litestar writes dicts into the document as they are.
                stream = OpenAPIMediaType(schema=event)  # type: ignore[arg-type]
                ok.content = {**(ok.content or {}), "text/event-stream": stream}

    return EventStreamOperation
