"""POST /v1/messages and /v1/messages/count_tokens.

Both read the body themselves, so malformed input gets Anthropic's error shape from
the route's own exception handlers; query strings such as ``?beta=true`` are ignored.
"""

from __future__ import annotations

from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator

from litestar import Request, Response, post

from ninfer.frontend.pipeline import Pipeline, Run
from ninfer.sampling_params import SamplingParams
from ninfer.server.admission import request_id
from ninfer.server.body import parse_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.middleware import ERROR_VIEW_OPT
from ninfer.server.openapi import BODY_ERRORS, ERROR_SHAPE_OPT, documented, error_responses, json_response
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.anthropic_messages import openapi as doc
from ninfer_plugins.protocols.anthropic_messages.errors import (
    EXCEPTION_HANDLERS,
    GATEWAY_TIMEOUT,
    OVERLOADED,
    REQUEST_ID_HEADER,
    error_frame,
    error_view,
)
from ninfer_plugins.protocols.anthropic_messages.output import MessageState
from ninfer_plugins.protocols.anthropic_messages.prepare import count, generate_request
from ninfer_plugins.protocols.anthropic_messages.schema import (
    Message,
    MessagesRequest,
    TokenCount,
    decode_request,
    encoder,
)
from ninfer_plugins.protocols.anthropic_messages.stream import PING, frames
from ninfer_plugins.protocols.anthropic_messages.validate import check_model, sampling_params

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"


def messages_routes(state: ServerState) -> list:
    pipeline = Pipeline(state)
    default_max = state.profile.engine.default_max_tokens

    def checked(body: bytes) -> MessagesRequest:
        req = decode_request(body)
        check_model(req.model)
        return req

    def parse(body: bytes) -> tuple[MessagesRequest, SamplingParams]:
        req = checked(body)
        return req, sampling_params(req, state.vocab_size)

    @post("/v1/messages", summary="Create a message", tags=["Anthropic"], status_code=200,
          exception_handlers=EXCEPTION_HANDLERS,
          description="Anthropic Messages; `stream: true` answers with Anthropic's server-sent events.",
          responses={200: json_response(doc.MessageDoc, "The message, or (stream: true) Anthropic's events"),
                     **_errors(*BODY_ERRORS, 503, GATEWAY_TIMEOUT, OVERLOADED)},
          operation_class=documented(body=doc.MessagesRequestDoc, events=doc.EVENTS),
          opt={ERROR_SHAPE_OPT: doc.AnthropicError, ERROR_VIEW_OPT: error_view})
    async def create_message(request: Request) -> Response:
        req, params = await parse_body(request, parse)
        rid = request_id()
        max_tokens = req.max_tokens or default_max
        run = await pipeline.prepare(partial(generate_request, req, params, state.lora_for(req.model), rid,
                                             max_tokens), stream=bool(req.stream))
        message = MessageState(run.choices[0], max_tokens)
        message_id, model = "msg_" + rid.removeprefix("req_"), req.model or ""
        headers = {REQUEST_ID_HEADER: rid}
        if req.stream:
            return sse_response(_frames(run, message, message_id, model), on_error=partial(error_frame, rid),
                                headers=headers, keepalive_frame=PING)
        result = await cancel_on_disconnect(request, _aggregate(run, message, message_id, model))
        return Response(encoder.encode(result), media_type=JSON, headers=headers)

    @post("/v1/messages/count_tokens", summary="Count a message's input tokens", tags=["Anthropic"],
          status_code=200, exception_handlers=EXCEPTION_HANDLERS,
          description="The input_tokens the same request reports when run, without generating.",
          responses={200: json_response(doc.COUNT, "The prompt's token count"), **_errors(*BODY_ERRORS)},
          operation_class=documented(body=doc.MessagesRequestDoc), opt={ERROR_SHAPE_OPT: doc.AnthropicError})
    async def count_tokens(request: Request) -> Response:
        req = await parse_body(request, checked)
        rendered = await state.run_blocking(count, req, pipeline)
        return Response(encoder.encode(TokenCount(len(rendered.token_ids))), media_type=JSON,
                        headers={REQUEST_ID_HEADER: request_id()})

    return [create_message, count_tokens]


def _errors(*statuses: int) -> dict:
    return error_responses(*statuses, container=doc.AnthropicError, why=doc.ERROR_REASONS)


async def _aggregate(run: Run, message: MessageState, message_id: str, model: str) -> Message:
    # aclosing: a failure here must abort the engine request now, not at GC
    async with aclosing(run.events()) as events:
        async for event in events:
            message.feed(event)
    return message.message(message_id, model)


async def _frames(run: Run, message: MessageState, message_id: str, model: str) -> AsyncIterator[bytes]:
    async with aclosing(run.events()) as events, aclosing(frames(message, events, message_id, model)) as out:
        async for payload in out:
            yield payload
