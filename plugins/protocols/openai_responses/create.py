"""POST /v1/responses: lower (with the stored parent), run the pipeline, store, answer as JSON or events."""

from __future__ import annotations

from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import msgspec
from litestar import Request, Response

from ninfer.errors import NotFoundError
from ninfer.frontend.pipeline import Rendered, Run
from ninfer.frontend.pipeline_request import CachePolicy, GenerateRequest
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.sampling_params import SamplingParams
from ninfer.server.body import parse_body
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.sse import sse_response
from ninfer_plugins.protocols.openai_responses.guided import text_format_guide
from ninfer_plugins.protocols.openai_responses.prepare import Lowered, Prepared, PromptContext, lower, prepare
from ninfer_plugins.protocols.openai_responses.response import Echo, Turn, new_response_id
from ninfer_plugins.protocols.openai_responses.schema import CreateRequest, PromptFields, decode
from ninfer_plugins.protocols.openai_responses.store import ResponseStore, StoredResponse, conversation_bytes
from ninfer_plugins.protocols.openai_responses.stream import Finalize, early_failure, frames
from ninfer_plugins.protocols.openai_responses.transcript import Transcript
from ninfer_plugins.protocols.openai_responses.validate import check_create, sampling_params

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


class Creation:
    """One Create request from preparation to its stored, rendered answer."""

    def __init__(self, state: ServerState, ctx: PromptContext, store: ResponseStore):
        self.state, self.ctx, self.store = state, ctx, store
        self.pipeline = ctx.pipeline

    def parse(self, body: bytes) -> tuple[CreateRequest, SamplingParams]:
        req = decode(body, CreateRequest)
        self.state.check_model(req.model, required=True)
        check_create(req)
        return req, sampling_params(req, self.state.vocab_size)

    async def __call__(self, request: Request) -> Response:
        state = self.state
        req, params = await parse_body(request, self.parse)
        keep = req.store is not False
        parent = parent_of(req, self.store)
        rid = new_response_id()
        lowered: Optional[Lowered] = None

        def lowering() -> GenerateRequest:  # the pipeline runs it off the loop, after admission
            nonlocal lowered
            lowered = lower(req, self.ctx, parent, keep)
            return GenerateRequest([lowered.prompt], params, lora=state.lora_for(req.model),
                                   tools=lowered.tools.request, answer=text_format_guide(req.text), request_id=rid,
                                   prompt_param="input", max_tokens_param="max_output_tokens",
                                   cache=CachePolicy(replay=parent is not None))

        run = await self.pipeline.prepare(lowering, stream=bool(req.stream))
        assert lowered is not None
        rendered = run.prompts[0]
        earlier_bytes = parent.conversation_bytes if parent is not None else 0
        if keep:  # a Response that can never be stored fails before it is generated
            self.store.check_fits(earlier_bytes + 2 * conversation_bytes(lowered.input_items))
        turn = Turn(rid, Echo.of(req, state.model_id), run.choices[0], lowered.tools.identities, req.include)
        kept: Lowered = lowered  # set by now; a name the closure below sees as such

        async def finalize() -> dict[str, Any]:
            response = turn.response()
            if keep:
                self.store.put(rid, self._record(kept, rendered, response, earlier_bytes, turn))
            return response

        if req.stream:
            return sse_response(self._frames(turn, run, finalize), on_error=partial(early_failure, turn))
        result = await cancel_on_disconnect(request, self._aggregate(turn, run, finalize))
        return Response(msgspec.json.encode(result), media_type=JSON)

    def _record(self, lowered: Lowered, rendered: Rendered, response: dict[str, Any], earlier_bytes: int,
                turn: Turn) -> StoredResponse:
        new = (*lowered.input_items, *response["output"])
        assert rendered.options is not None
        return StoredResponse(
            response=response,
            input_items=lowered.input_items,
            conversation=(*lowered.earlier, *new),
            conversation_bytes=earlier_bytes + conversation_bytes(new),
            preserve_thinking=rendered.options.preserve_thinking,
            transcript=Transcript.of(rendered.text, rendered.token_ids, turn.output_ids, self.ctx.tokenizer),
        )

    async def _aggregate(self, turn: Turn, run: Run, finalize: Finalize) -> dict[str, Any]:
        # aclosing: a failure here must abort the engine request now, not at GC
        async with aclosing(run.events()) as events:
            async for event in events:
                turn.feed(event)
        return await finalize()

    async def _frames(self, turn: Turn, run: Run, finalize: Finalize) -> AsyncIterator[bytes]:
        async with aclosing(run.events()) as events, aclosing(frames(turn, events, finalize)) as out:
            async for frame in out:
                yield frame
