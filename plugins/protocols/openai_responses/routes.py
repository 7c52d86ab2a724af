"""The Responses routes: create, count, and the local store's retrieve/list/delete.

Cancel and compaction exist as routes only to fail explicitly: background execution
and server-side compaction are not offered, so their documents list no success. The
shapes of every answer are in :mod:`.openapi`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import MultiDict
from litestar.params import Parameter

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.pipeline import Pipeline
from ninfer.server.body import parse_body
from ninfer.server.openapi import BODY_ERRORS, GENERATION_ERRORS, documented, error_responses, json_response
from ninfer_plugins.protocols.openai_responses import openapi as doc
from ninfer_plugins.protocols.openai_responses.create import Creation, not_found, prepare_prompt
from ninfer_plugins.protocols.openai_responses.prepare import PromptContext
from ninfer_plugins.protocols.openai_responses.schema import CountRequest, decode
from ninfer_plugins.protocols.openai_responses.store import ResponseStore
from ninfer_plugins.protocols.openai_responses.validate import check_count

if TYPE_CHECKING:
    from ninfer.server.state import ServerState

JSON = "application/json"
TAGS = ["OpenAI Responses"]
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
ResponseId = Annotated[str, Parameter(description="a stored Response's id")]


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), media_type=JSON, status_code=status)


def _values(query: MultiDict, name: str) -> list[str]:
    """A query parameter's values under ``name`` and its ``name[]`` spelling."""
    return [*query.getall(name, []), *query.getall(f"{name}[]", [])]


def _refuse_include(query: MultiDict) -> None:
    if any(_values(query, "include")):
        raise UnsupportedFeatureError("include: stored Responses are returned as they are; nothing more can be "
                                      "included", param="include")


def _page(items: list[dict[str, Any]], query: MultiDict) -> dict[str, Any]:
    """One page of ``items`` (each with an id) for ``after``, ``limit`` and ``order``."""
    raw_limit = query.get("limit")
    try:
        limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequestError(f"limit must be an integer in 1..{MAX_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be asc or desc", param="order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequestError(f"no input Item of this Response has id {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def responses_routes(state: ServerState) -> list:
    def parse_count(body: bytes) -> CountRequest:
        req = decode(body, CountRequest)
        state.check_model(req.model)
        check_count(req)
        return req

    ctx = PromptContext.of(Pipeline(state))
    server = state.profile.server
    store = ResponseStore(server.response_store_max_records, server.response_store_max_mib)
    state.extras["openai_responses.store"] = store
    creation = Creation(state, ctx, store)

    @post("/v1/responses", summary="Create a Response", tags=TAGS, status_code=200,
          operation_class=documented(body=doc.CREATE_BODY, events=doc.EVENTS, links=doc.CREATE_LINKS),
          responses={200: json_response(doc.ResponseObject, "The Response, or (stream: true) its semantic events"),
                     **error_responses(*GENERATION_ERRORS)},
          description="OpenAI Responses: typed input Items in, typed output Items out; `stream: true` answers "
                      "with semantic server-sent events.")
    async def create_response(request: Request) -> Response:
        return await creation(request)

    @post("/v1/responses/input_tokens", summary="Count a Response's input tokens", tags=TAGS, status_code=200,
          operation_class=documented(body=doc.COUNT_BODY),
          responses={200: json_response(doc.InputTokens, "The prompt's token count"),
                     **error_responses(*BODY_ERRORS, 404)})
    async def count_input_tokens(request: Request) -> Response:
        req = await parse_body(request, parse_count)
        prepared, _ = await prepare_prompt(state, ctx, store, req, keep=False)
        return _json({"object": "response.input_tokens", "input_tokens": len(prepared.prompt_ids)})

    @get("/v1/responses/{response_id:str}", summary="Retrieve a stored Response", tags=TAGS, sync_to_thread=False,
         operation_id="retrieve_response", operation_class=documented(parameters=doc.RETRIEVE_QUERY),
         responses={200: json_response(doc.ResponseObject, "The stored Response"), **error_responses(400, 404, 500)})
    def retrieve_response(request: Request, response_id: ResponseId) -> Response:
        if request.query_params.get("stream") in ("true", "1", "True"):
            raise UnsupportedFeatureError("stream: finished Responses cannot be streamed again", param="stream")
        _refuse_include(request.query_params)
        record = store.get(response_id)
        if record is None:
            raise not_found(response_id)
        return _json(record.response)

    @delete("/v1/responses/{response_id:str}", summary="Delete a stored Response", tags=TAGS, status_code=200,
            sync_to_thread=False, operation_id="delete_response",
            responses={200: json_response(doc.Deleted, "Deleted"), **error_responses(400, 404, 500)})
    def delete_response(response_id: ResponseId) -> Response:
        if not store.delete(response_id):
            raise not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    @get("/v1/responses/{response_id:str}/input_items", summary="List a stored Response's input Items",
         tags=TAGS, sync_to_thread=False, operation_id="list_input_items",
         operation_class=documented(parameters=doc.items_query(DEFAULT_LIMIT, MAX_LIMIT)),
         responses={200: json_response(doc.ItemPage, "One page of the Items"), **error_responses(400, 404, 500)})
    def list_input_items(request: Request, response_id: ResponseId) -> Response:
        _refuse_include(request.query_params)
        record = store.get(response_id)
        if record is None:
            raise not_found(response_id)
        return _json(_page(record.input_items, request.query_params))

    @post("/v1/responses/{response_id:str}/cancel", summary="Cancel (always fails)", tags=TAGS,
          sync_to_thread=False, operation_class=documented(success=False),
          description="Only background Responses can be cancelled and none run here: a stored id answers 400 "
                      "`background_not_supported`, any other 404.",
          responses=error_responses(400, 404, 500))
    def cancel_response(response_id: ResponseId) -> Response:
        if store.get(response_id) is None:
            raise not_found(response_id)
        raise InvalidRequestError("only background Responses can be cancelled, and background execution is not "
                                  "supported", code="background_not_supported")

    @post("/v1/responses/compact", summary="Compact a conversation (always fails)", tags=TAGS, sync_to_thread=False,
          operation_class=documented(success=False), responses=error_responses(400, 500),
          description="Server-side compaction is not offered: always 400 `compaction_not_supported`.")
    def compact_response() -> Response:
        raise InvalidRequestError("server-side conversation compaction is not supported",
                                  code="compaction_not_supported")

    return [create_response, count_input_tokens, retrieve_response, delete_response, list_input_items,
            cancel_response, compact_response]
