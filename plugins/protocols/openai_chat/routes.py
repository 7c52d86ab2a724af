"""POST /v1/chat/completions: validate, render the prompt, run n engine requests, answer."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import attrs
from litestar import Request, Response, post

from ninfer.engine.request import EngineRequest
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.frontend.thinking import thinking_budget
from ninfer.sampling_params import SamplingParams
from ninfer.server.admission import request_id
from ninfer.server.body import strict_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.openapi import ErrorResponse, error_responses, event_stream_operation, json_response
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_chat.choice import ChoiceState
from ninfer_plugins.protocols.openai_chat.guided import chat_guide
from ninfer.frontend.fanout import generate_all
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.frontend.parsers import make_splitter, reasoning_parser, starts_in_reasoning
from ninfer_plugins.protocols.openai_chat.render import MessageBuilder, completion
from ninfer_plugins.protocols.openai_chat.schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    encoder,
)
from ninfer_plugins.protocols.openai_chat.stream import ChunkStream, chunks
from ninfer_plugins.protocols.openai_chat.translate import Prepared, prepare, sampling_params
from ninfer_plugins.protocols.openai_chat.validate import validate_request
from ninfer.frontend.tool_guide import tool_parser

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"


def default_thinking_budget(state: ServerState, req: ChatCompletionRequest, prepared: Prepared,
                            params: SamplingParams) -> ThinkingBudget | None:
    """The server's ``--default-thinking-budget`` for a request that thinks (None: uncapped).

    The output limit it must fit in is the request's, or else the one the engine applies.
    """
    budget = state.profile.reasoning.default_thinking_budget
    if budget is None or not prepared.options.thinking:
        return None
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(state.profile.engine.default_max_tokens, state.max_model_len - len(prepared.prompt_ids))
    parser = reasoning_parser(state)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return thinking_budget(state.tokenizer, parser, budget, max_tokens,
                           open_at_start=starts_in_reasoning(prepared.prompt, parser), param=param)


def engine_requests(rid: str, prepared: Prepared, params: SamplingParams, n: int,
                    budget: ThinkingBudget | None = None, lora: str | None = None) -> list[EngineRequest]:
    return [
        EngineRequest(f"{rid}-{i}", prepared.prompt_ids, params, prompt=prepared.prompt,
                      thinking=prepared.options.thinking, thinking_budget=budget, lora_name=lora, sample_index=i)
        for i in range(n)
    ]


def chat_routes(state: ServerState) -> list:
    tokenizer = state.tokenizer
    vocab_size = state.engine.engine.vocab_size

    @post(
        "/v1/chat/completions",
        summary="Create a chat completion",
        description="OpenAI Chat Completions; `stream: true` answers with server-sent events.",
        responses={200: json_response(ChatCompletion, "The completion, or (stream: true) server-sent events: "
                                      "chat.completion.chunk objects, then [DONE]"),
                   **error_responses(400, 404, 413, 429, 500, 503)},
        operation_class=event_stream_operation(ChatCompletionChunk, ErrorResponse),
        tags=["OpenAI"],
        status_code=200,
    )
    async def create_chat_completion(request: Request, data: ChatCompletionRequest) -> Response:
        data = await strict_body(request, ChatCompletionRequest)  # strict types: see ninfer.server.body
        state.check_model(data.model)
        validate_request(data)
        params = sampling_params(data, vocab_size)
        state.gate.reserve()  # a full server answers 429 before any preparation work
        params.guided = await state.run_blocking(chat_guide, data, tool_parser(state))
        prepared = await state.run_blocking(prepare, data, tokenizer, state.profile)
        check_prompt_length(len(prepared.prompt_ids), state.max_model_len)
        budget = default_thinking_budget(state, data, prepared, params)
        rid = request_id()
        requests = engine_requests(rid, prepared, params, data.n or 1, budget, state.lora_for(data.model))
        states = [ChoiceState(i, tokenizer, make_splitter(state, prepared.prompt, prepared.tools))
                  for i in range(len(requests))]
        answer = _Answer(state, f"chatcmpl-{rid}", int(time.time()), data.model or state.model_id, requests, states)
        want_logprobs = bool(data.logprobs)
        if data.stream:
            options = data.stream_options
            stream = ChunkStream(answer.id, answer.created, answer.model, states, want_logprobs=want_logprobs,
                                 include_usage=bool(options and options.include_usage),
                                 timings_per_token=bool(data.timings_per_token),
                                 return_progress=bool(data.return_progress))
            return sse_response(answer.frames(stream))
        result = await cancel_on_disconnect(request, answer.aggregate(want_logprobs))
        return Response(encoder.encode(result), media_type=JSON)

    return [create_chat_completion]


@attrs.define
class _Answer:
    state: ServerState
    id: str
    created: int
    model: str
    requests: list[EngineRequest]
    states: list[ChoiceState]

    async def aggregate(self, want_logprobs: bool) -> ChatCompletion:
        builders = [MessageBuilder(want_logprobs) for _ in self.states]
        # aclosing: a failure in this loop must abort the engine requests now, not at GC
        async with aclosing(generate_all(self.state, self.requests)) as events:
            async for index, event in events:
                choice = self.states[index]
                deltas = choice.feed(event)
                builders[index].add(deltas, choice.logprobs(event.logprobs) if want_logprobs else ())
        return completion(self.id, self.created, self.model, self.states, builders)

    async def frames(self, stream: ChunkStream) -> Any:
        async with aclosing(generate_all(self.state, self.requests)) as events, \
                aclosing(chunks(stream, events)) as payloads:
            async for payload in payloads:
                yield f"data: {payload}\n\n"
        yield "data: [DONE]\n\n"
