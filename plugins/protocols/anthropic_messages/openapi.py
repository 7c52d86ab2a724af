"""What /v1/messages and /v1/messages/count_tokens accept and answer, for the OpenAPI document.

The handlers decode loosely (:mod:`.schema` types only the top level) so that every
error can name its exact field in Anthropic's shape; these types describe the wire as
Anthropic's API defines it, as far as this server reads or writes it: request content
blocks, the Message answer, each streamed event, and the error body. They are never
used to decode, only to document (tests/test_openapi_fuzz.py checks the answers against
them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from msgspec import Meta, Struct

from ninfer_plugins.protocols.anthropic_messages.errors import GATEWAY_TIMEOUT, OVERLOADED
from ninfer_plugins.protocols.anthropic_messages.schema import TokenCount, Usage

NonEmpty = Annotated[str, Meta(min_length=1)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Share = Annotated[float, Meta(gt=0.0, le=1.0)]


# -- the request -----------------------------------------------------------------------
class CacheControl(Struct, kw_only=True):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextParam(Struct, tag="text", tag_field="type"):
    text: str
    cache_control: Optional[CacheControl] = None


class ImageParam(Struct, tag="image", tag_field="type"):
    """Accepted in form; the server runs no vision model and answers 400 ``vision_disabled``."""

    source: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolUseParam(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultParam(Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: Union[str, list[dict[str, Any]], None] = None
    is_error: Optional[bool] = None


class ThinkingParam(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingParam(Struct, tag="redacted_thinking", tag_field="type"):
    data: str


ContentParam = Union[TextParam, ImageParam, ToolUseParam, ToolResultParam, ThinkingParam, RedactedThinkingParam]


class MessageParam(Struct):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentParam]]


class ToolParam(Struct, kw_only=True):
    name: NonEmpty
    input_schema: dict[str, Any]
    description: Optional[str] = None
    input_examples: Optional[list[dict[str, Any]]] = None
    cache_control: Optional[CacheControl] = None


class ToolChoiceParam(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    #: required when enabled
    budget_tokens: Optional[Annotated[int, Meta(ge=1024)]] = None


class MessagesRequestDoc(Struct, kw_only=True):
    """A Messages request (unknown top-level members are accepted and ignored)."""

    #: any non-empty label: echoed back; a LoRA adapter's name selects it
    model: NonEmpty
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    #: the server's --default-max-tokens when absent
    max_tokens: Optional[Annotated[int, Meta(ge=1)]] = None
    system: Union[str, list[TextParam], None] = None
    stream: bool = False
    temperature: Optional[Unit] = None
    top_p: Optional[Share] = None
    top_k: Optional[Annotated[int, Meta(ge=0)]] = None
    stop_sequences: Optional[list[str]] = None
    thinking: Optional[ThinkingConfig] = None
    tools: Optional[list[ToolParam]] = None
    tool_choice: Optional[ToolChoiceParam] = None
    metadata: Optional[dict[str, Any]] = None
    cache_control: Optional[CacheControl] = None
    #: ``{"effort": ..., "format": {"type": "json_schema", "schema": {...}}}``
    output_config: Optional[dict[str, Any]] = None
    #: ninfer extension: keep the reasoning of closed assistant turns in the prompt
    preserve_thinking: Optional[bool] = None
    service_tier: Optional[str] = None


# -- the answer ------------------------------------------------------------------------
class TextBlock(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessageDoc(Struct, kw_only=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Optional[StopReason]
    stop_sequence: Optional[str]
    usage: Usage


class ErrorDetail(Struct):
    type: str
    message: str


class AnthropicError(Struct, tag="error", tag_field="type"):
    """Every error of these routes; ``request_id`` equals the ``request-id`` header."""

    error: ErrorDetail
    request_id: str


# -- the stream: each event's data (its ``event:`` name equals ``type``) ------------------
class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: MessageDoc


class Ping(Struct, tag="ping", tag_field="type"):
    pass


class BlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class BlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: Union[TextDelta, ThinkingDelta, SignatureDelta, InputJsonDelta]


class BlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDetail(Struct):
    stop_reason: Optional[StopReason]
    stop_sequence: Optional[str]


class MessageDelta(Struct, tag="message_delta", tag_field="type"):
    delta: StopDetail
    usage: Usage


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass


#: the payloads of a stream's events
EVENTS = (MessageStart, Ping, BlockStart, BlockDelta, BlockStop, MessageDelta, MessageStop, AnthropicError)
COUNT = TokenCount  # the count's answer, as the handler encodes it
#: Anthropic's statuses for the core's refusals (see :mod:`.errors`)
ERROR_REASONS = {
    503: "The server is shutting down or the engine is unavailable",
    GATEWAY_TIMEOUT: "Not admitted within the pending timeout",
    OVERLOADED: "Every running and waiting slot is taken; retry later",
}
