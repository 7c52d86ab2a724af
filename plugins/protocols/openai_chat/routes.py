"""POST /v1/chat/completions: parse and validate, hand the pipeline its request, render the answer."""

from __future__ import annotations

import time
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, post

from ninfer.frontend.pipeline import Pipeline, Run
from ninfer.sampling_params import SamplingParams
from ninfer.server.body import parse_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.openapi import (
    GENERATION_ERRORS,
    ErrorResponse,
    error_responses,
    event_stream_operation,
    json_response,
)
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_chat.choice import wire_logprobs
from ninfer_plugins.protocols.openai_chat.render import MessageBuilder, completion
from ninfer_plugins.protocols.openai_chat.schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    encoder,
)
from ninfer_plugins.protocols.openai_chat.stream import ChunkStream, chunks
from ninfer_plugins.protocols.openai_chat.translate import generate_request, sampling_params
from ninfer_plugins.protocols.openai_chat.validate import validate_request

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"


def chat_routes(state: ServerState) -> list:
    pipeline = Pipeline(state)

    def parse(body: bytes) -> tuple[ChatCompletionRequest, SamplingParams]:
        data = msgspec.json.decode(body, type=ChatCompletionRequest)  # strict types: see ninfer.server.body
        state.check_model(data.model)
        validate_request(data)
        return data, sampling_params(data, state.vocab_size)

    @post(
        "/v1/chat/completions",
        summary="Create a chat completion",
        description="OpenAI Chat Completions; `stream: true` answers with server-sent events.",
        responses={200: json_response(ChatCompletion, "The completion, or (stream: true) server-sent events: "
                                      "chat.completion.chunk objects, then [DONE]"),
                   **error_responses(*GENERATION_ERRORS)},
        operation_class=event_stream_operation(ChatCompletionChunk, ErrorResponse, body=ChatCompletionRequest),
        tags=["OpenAI"],
        status_code=200,
    )
    async def create_chat_completion(request: Request) -> Response:
        data, params = await parse_body(request, parse)
        run = await pipeline.prepare(partial(generate_request, data, params, state.lora_for(data.model)),
                                   stream=bool(data.stream))
        chat_id, created, model = f"chatcmpl-{run.request_id}", int(time.time()), data.model or state.model_id
        want_logprobs = bool(data.logprobs)
        if data.stream:
            options = data.stream_options
            stream = ChunkStream(chat_id, created, model, run.choices, state.tokenizer, want_logprobs=want_logprobs,
                                 include_usage=bool(options and options.include_usage),
                                 timings_per_token=bool(data.timings_per_token),
                                 return_progress=bool(data.return_progress))
            return sse_response(_frames(run, stream))
        answer = _aggregate(run, state.tokenizer, chat_id, created, model, want_logprobs)
        return Response(encoder.encode(await cancel_on_disconnect(request, answer)), media_type=JSON)

    return [create_chat_completion]


async def _aggregate(run: Run, tokenizer: Any, chat_id: str, created: int, model: str,
                     want_logprobs: bool) -> ChatCompletion:
    builders = [MessageBuilder(want_logprobs) for _ in run.choices]
    # aclosing: a failure in this loop must abort the engine requests now, not at GC
    async with aclosing(run.events()) as events:
        async for event in events:
            builders[event.index].add(event.deltas, wire_logprobs(tokenizer, event.logprobs) if want_logprobs else ())
    return completion(chat_id, created, model, run.choices, builders)


async def _frames(run: Run, stream: ChunkStream) -> Any:
    async with aclosing(run.events()) as events, aclosing(chunks(stream, events)) as payloads:
        async for payload in payloads:
            yield f"data: {payload}\n\n"
    yield "data: [DONE]\n\n"
