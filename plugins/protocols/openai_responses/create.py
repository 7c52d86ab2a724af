"""POST /v1/responses: prepare, generate, store, answer as JSON or as events."""

from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import msgspec
from litestar import Request, Response

from ninfer.engine.request import EngineRequest
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import NotFoundError
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.frontend.parsers import make_splitter, reasoning_parser, starts_in_reasoning
from ninfer.frontend.thinking import thinking_budget
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_responses.guided import response_guide
from ninfer_plugins.protocols.openai_responses.prepare import Prepared, PromptContext, prepare
from ninfer_plugins.protocols.openai_responses.response import Echo, Turn, new_response_id
from ninfer_plugins.protocols.openai_responses.schema import CreateRequest, PromptFields
from ninfer_plugins.protocols.openai_responses.store import ResponseStore, StoredResponse, conversation_bytes
from ninfer_plugins.protocols.openai_responses.stream import Finalize, frames
from ninfer_plugins.protocols.openai_responses.transcript import Transcript
from ninfer_plugins.protocols.openai_responses.validate import check_create, sampling_params
from ninfer.frontend.tool_guide import tool_parser

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"


def not_found(response_id: str, param: Optional[str] = None) -> NotFoundError:
    return NotFoundError(f"no stored Response has id {response_id!r} (never stored, evicted, or deleted)",
                         param=param, code="response_not_found")


def parent_of(req: PromptFields, store: ResponseStore) -> Optional[StoredResponse]:
    if req.previous_response_id is None:
        return None
    parent = store.get(req.previous_response_id)
    if parent is None:
        raise not_found(req.previous_response_id, "previous_response_id")
    return parent


async def prepare_prompt(state: ServerState, ctx: PromptContext, store: ResponseStore, req: PromptFields,
                         keep: bool) -> tuple[Prepared, Optional[StoredResponse]]:
    """The request's prompt; too long a prompt is the input's fault, whatever the output budget."""
    parent = parent_of(req, store)
    prepared = await state.run_blocking(prepare, req, ctx, parent, keep)
    check_prompt_length(len(prepared.prompt_ids), state.max_model_len, param="input")
    return prepared, parent


def default_thinking_budget(state: ServerState, prepared: Prepared,
                            max_tokens: Optional[int]) -> Optional[ThinkingBudget]:
    """The server's ``--default-thinking-budget`` for a request that thinks (None: uncapped).

    The output limit it must fit in is the request's, or else the one the engine applies.
    """
    budget = state.profile.reasoning.default_thinking_budget
    if budget is None or not prepared.options.thinking:
        return None
    if max_tokens is None:
        max_tokens = min(state.profile.engine.default_max_tokens, state.max_model_len - len(prepared.prompt_ids))
    parser = reasoning_parser(state)
    return thinking_budget(state.tokenizer, parser, budget, max_tokens,
                           open_at_start=starts_in_reasoning(prepared.prompt, parser), param="max_output_tokens")


class Creation:
    """One Create request from preparation to its stored, rendered answer."""

    def __init__(self, state: ServerState, ctx: PromptContext, store: ResponseStore):
        self.state, self.ctx, self.store = state, ctx, store

    async def __call__(self, request: Request, req: CreateRequest) -> Response:
        state = self.state
        state.check_model(req.model, required=True)
        check_create(req)
        params = sampling_params(req, state.engine.engine.vocab_size)
        state.gate.reserve()  # a full server answers 429 before any preparation work
        keep = req.store is not False
        prepared, parent = await prepare_prompt(state, self.ctx, self.store, req, keep)
        params.guided = await state.run_blocking(response_guide, req.text, prepared.tools, tool_parser(state))
        earlier_bytes = parent.conversation_bytes if parent is not None else 0
        if keep:  # a Response that can never be stored fails before it is generated
            self.store.check_fits(earlier_bytes + 2 * conversation_bytes(prepared.input_items))
        rid = new_response_id()
        turn = Turn(rid, Echo.of(req, state.model_id),
                    make_splitter(state, prepared.prompt, prepared.tools.definitions),
                    prepared.tools.identities, req.include)
        engine_request = EngineRequest(rid, prepared.prompt_ids, params, prompt=prepared.prompt,
                                       thinking=prepared.options.thinking, lora_name=state.lora_for(req.model),
                                       thinking_budget=default_thinking_budget(state, prepared, params.max_tokens))

        async def finalize() -> dict[str, Any]:
            response = turn.response()
            if keep:
                self.store.put(rid, self._record(prepared, response, earlier_bytes, turn))
            return response

        if req.stream:
            return sse_response(self._frames(turn, engine_request, finalize))
        result = await cancel_on_disconnect(request, self._aggregate(turn, engine_request, finalize))
        return Response(msgspec.json.encode(result), media_type=JSON)

    def _record(self, prepared: Prepared, response: dict[str, Any], earlier_bytes: int,
                turn: Turn) -> StoredResponse:
        new = (*prepared.input_items, *response["output"])
        return StoredResponse(
            response=response,
            input_items=prepared.input_items,
            conversation=(*prepared.earlier, *new),
            conversation_bytes=earlier_bytes + conversation_bytes(new),
            preserve_thinking=prepared.options.preserve_thinking,
            transcript=Transcript.of(prepared.prompt, prepared.prompt_ids, turn.output_ids, self.ctx.tokenizer),
        )

    async def _aggregate(self, turn: Turn, engine_request: EngineRequest, finalize: Finalize) -> dict[str, Any]:
        # aclosing: a failure here must abort the engine request now, not at GC
        async with aclosing(self.state.generate(engine_request)) as events:
            async for event in events:
                turn.feed(event)
        return await finalize()

    async def _frames(self, turn: Turn, engine_request: EngineRequest, finalize: Finalize) -> AsyncIterator[bytes]:
        async with aclosing(self.state.generate(engine_request)) as events, \
                aclosing(frames(turn, events, finalize)) as out:
            async for frame in out:
                yield frame

