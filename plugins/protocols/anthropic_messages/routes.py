"""POST /v1/messages and /v1/messages/count_tokens.

Both read the body themselves, so malformed input gets Anthropic's error shape from
the route's own exception handlers; query strings such as ``?beta=true`` are ignored.
"""

from __future__ import annotations

from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator

from litestar import Request, Response, post

from ninfer.engine.request import EngineRequest
from ninfer.frontend.parsers import make_splitter, reasoning_parser
from ninfer.server.admission import request_id
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.anthropic_messages.errors import (
    EXCEPTION_HANDLERS,
    REQUEST_ID_HEADER,
    error_frame,
)
from ninfer_plugins.protocols.anthropic_messages.output import MessageState
from ninfer_plugins.protocols.anthropic_messages.prepare import Context, prepare
from ninfer_plugins.protocols.anthropic_messages.schema import Message, TokenCount, decode_request, encoder
from ninfer_plugins.protocols.anthropic_messages.stream import PING, frames
from ninfer_plugins.protocols.anthropic_messages.validate import check_model, sampling_params
from ninfer.frontend.tool_guide import tool_parser

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"


def messages_routes(state: ServerState) -> list:
    ctx = Context(state.tokenizer, state.profile, reasoning_parser(state), state.max_model_len, tool_parser(state))
    vocab_size = state.engine.engine.vocab_size
    default_max = state.profile.engine.default_max_tokens

    @post("/v1/messages", summary="Create a message", tags=["Anthropic"], status_code=200,
          exception_handlers=EXCEPTION_HANDLERS,
          description="Anthropic Messages; `stream: true` answers with Anthropic's server-sent events.")
    async def create_message(request: Request) -> Response:
        req = decode_request(await request.body())
        check_model(req.model)
        params = sampling_params(req, vocab_size)
        state.gate.reserve()  # a full server answers 529 before any preparation work
        prepared = await state.run_blocking(prepare, req, ctx)
        params.guided = prepared.guide
        rid = request_id()
        engine_request = EngineRequest(rid, prepared.prompt_ids, params, prompt=prepared.prompt,
                                       lora_name=state.lora_for(req.model),
                                       thinking=prepared.thinking, thinking_budget=prepared.budget)
        message = MessageState(make_splitter(state, prepared.prompt, prepared.tools), req.max_tokens or default_max)
        answer = _Answer(state, engine_request, message, "msg_" + rid.removeprefix("req_"), req.model or "")
        headers = {REQUEST_ID_HEADER: rid}
        if req.stream:
            return sse_response(answer.frames(), on_error=partial(error_frame, rid), headers=headers,
                                keepalive_frame=PING)
        result = await cancel_on_disconnect(request, answer.aggregate())
        return Response(encoder.encode(result), media_type=JSON, headers=headers)

    @post("/v1/messages/count_tokens", summary="Count a message's input tokens", tags=["Anthropic"],
          status_code=200, exception_handlers=EXCEPTION_HANDLERS,
          description="The input_tokens the same request reports when run, without generating.")
    async def count_tokens(request: Request) -> Response:
        req = decode_request(await request.body())
        check_model(req.model)
        prepared = await state.run_blocking(prepare, req, ctx, False)
        return Response(encoder.encode(TokenCount(len(prepared.prompt_ids))), media_type=JSON,
                        headers={REQUEST_ID_HEADER: request_id()})

    return [create_message, count_tokens]


class _Answer:
    def __init__(self, state: Any, request: EngineRequest, message: MessageState, message_id: str, model: str):
        self.state, self.request, self.message = state, request, message
        self.id, self.model = message_id, model

    async def aggregate(self) -> Message:
        # aclosing: a failure here must abort the engine request now, not at GC
        async with aclosing(self.state.generate(self.request)) as events:
            async for event in events:
                self.message.feed(event)
        return self.message.message(self.id, self.model)

    async def frames(self) -> AsyncIterator[bytes]:
        async with aclosing(self.state.generate(self.request)) as events, \
                aclosing(frames(self.message, events, self.id, self.model)) as out:
            async for payload in out:
                yield payload
