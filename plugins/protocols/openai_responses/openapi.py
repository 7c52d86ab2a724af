"""What the Responses routes accept and answer, for the OpenAPI document.

The handlers build their answers as plain dicts (:mod:`.response`, :mod:`.output`,
:mod:`.routes`); these types describe those dicts, the stream's events and the store's
answers, so generated clients and the fuzz test (tests/test_openapi_fuzz.py) see the
real shapes. They are never used to decode or encode.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from litestar.openapi.spec import Link
from msgspec import Struct

from ninfer.server.openapi import query, require, self_contained_schema
from ninfer_plugins.protocols.openai_responses.schema import CountRequest, CreateRequest

Status = Literal["in_progress", "completed", "incomplete"]


# -- output Items ----------------------------------------------------------------------
class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class OutputMessage(Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class ReasoningItem(Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Status
    #: with ``include: ["reasoning.encrypted_content"]``: the text, sealed for replay
    encrypted_content: Optional[str] = None


class FunctionCall(Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status
    namespace: Optional[str] = None


OutputItem = Union[OutputMessage, ReasoningItem, FunctionCall]


# -- the Response object ---------------------------------------------------------------
class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: str


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ReasoningEcho(Struct):
    effort: Optional[str]
    summary: Optional[str]


class TextEcho(Struct):
    format: dict[str, Any]
    verbosity: str


class ResponseObject(Struct, kw_only=True):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    completed_at: Optional[int]
    error: Optional[ResponseError]
    incomplete_details: Optional[IncompleteDetails]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    max_tool_calls: Optional[int]
    model: str
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    prompt_cache_key: Optional[str]
    prompt_cache_retention: Optional[str]
    reasoning: ReasoningEcho
    safety_identifier: Optional[str]
    service_tier: str
    store: bool
    temperature: Optional[float]
    text: TextEcho
    tool_choice: Union[str, dict[str, Any]]
    tools: list[Any]
    top_logprobs: int
    top_p: Optional[float]
    truncation: str
    user: Optional[str]
    metadata: dict[str, Any]
    output: list[OutputItem]
    usage: Optional[ResponseUsage]


# -- stream events (each ``event:`` name equals ``type``) -----------------------------------
# Bases carry the members events share; each event adds its tag (and its own members).
class _Event(Struct, tag_field="type"):
    sequence_number: int


class _Lifecycle(_Event):
    response: ResponseObject


class _ItemEvent(_Event):
    output_index: int
    item: OutputItem


class _InItem(_Event):
    item_id: str
    output_index: int


class _InPart(_InItem):
    content_index: int


class Created(_Lifecycle, tag="response.created"):
    pass


class InProgress(_Lifecycle, tag="response.in_progress"):
    pass


class Completed(_Lifecycle, tag="response.completed"):
    pass


class Incomplete(_Lifecycle, tag="response.incomplete"):
    pass


class Failed(_Lifecycle, tag="response.failed"):
    pass


class ItemAdded(_ItemEvent, tag="response.output_item.added"):
    pass


class ItemDone(_ItemEvent, tag="response.output_item.done"):
    pass


class PartAdded(_InPart, tag="response.content_part.added"):
    part: Union[OutputText, ReasoningText]


class PartDone(_InPart, tag="response.content_part.done"):
    part: Union[OutputText, ReasoningText]


class TextDelta(_InPart, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Any]


class TextDone(_InPart, tag="response.output_text.done"):
    text: str
    logprobs: list[Any]


class ReasoningDelta(_InPart, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningDone(_InPart, tag="response.reasoning_text.done"):
    text: str


class ArgumentsDelta(_InItem, tag="response.function_call_arguments.delta"):
    delta: str


class ArgumentsDone(_InItem, tag="response.function_call_arguments.done"):
    name: str
    arguments: str


EVENTS = (Created, InProgress, Completed, Incomplete, Failed, ItemAdded, ItemDone, PartAdded, PartDone, TextDelta,
          TextDone, ReasoningDelta, ReasoningDone, ArgumentsDelta, ArgumentsDone)


# -- the other answers -----------------------------------------------------------------
class InputTokens(Struct):
    object: Literal["response.input_tokens"]
    input_tokens: int


class Deleted(Struct):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class StoredItem(Struct):
    """A canonical input Item as stored (its other members depend on its type)."""

    id: str
    type: Literal["message", "reasoning", "function_call", "function_call_output"]


class ItemPage(Struct):
    object: Literal["list"]
    data: list[StoredItem]
    first_id: Optional[str]
    last_id: Optional[str]
    has_more: bool


# -- request bodies and parameters -------------------------------------------------------
_TEXT_PART = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
#: an input Item: a message (``type`` may be left out when ``role`` is given), a reasoning Item,
#: a function call or its output; the handler checks each member and names the one it refuses
INPUT_ITEM = {"type": "object", "properties": {
    "type": {"enum": ["message", "reasoning", "function_call", "function_call_output"]},
    "id": {"type": "string", "minLength": 1},
    "role": {"enum": ["user", "assistant", "system", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
    "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
}}
_INPUT = {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_ITEM}, {"type": "null"}]}
_MODEL = {"type": "string", "minLength": 1, "description": "the served model's id or a LoRA adapter's name"}


#: members recognised only to refuse every value but null (validate._REFUSED says why)
_REFUSED = ("conversation", "prompt", "context_management", "moderation", "background_options", "access_programs",
            "image", "personality")


def _with_input(kind: Any) -> dict[str, Any]:
    schema = self_contained_schema(kind)
    properties = {**schema["properties"], "input": _INPUT}
    for name in _REFUSED:
        if name in properties:
            properties[name] = {"type": "null", "description": "not supported: any other value is a 400"}
    return {**schema, "properties": properties}


#: Create needs ``model`` (a 400 naming it when absent); the count takes it optionally
CREATE_BODY = require(_with_input(CreateRequest), "model", _MODEL)
COUNT_BODY = _with_input(CountRequest)
RETRIEVE_QUERY = (
    query("stream", {"type": "boolean"}, "true is refused: a finished Response cannot be streamed again"),
    query("include", {"type": "array", "items": {"type": "string"}}, "any value is refused"),
)


def items_query(default_limit: int, max_limit: int) -> tuple[Any, ...]:
    return (
        query("limit", {"type": "integer", "minimum": 1, "maximum": max_limit}, f"Items per page ({default_limit} "
              "when absent)"),
        query("order", {"enum": ["asc", "desc"]}, "input order (asc) or reversed (desc, the default)"),
        query("after", {"type": "string"}, "list the Items after the one with this id"),
        query("include", {"type": "array", "items": {"type": "string"}}, "any value is refused"),
    )


_STORED = {"response_id": "$response.body#/id"}
#: where a created Response's id is used next (clients and stateful fuzzers follow these)
CREATE_LINKS = {
    "retrieve": Link(operation_id="retrieve_response", parameters=_STORED),
    "input_items": Link(operation_id="list_input_items", parameters=_STORED),
    "delete": Link(operation_id="delete_response", parameters=_STORED),
}
