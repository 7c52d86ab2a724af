"""Wire shapes of POST /v1/messages and /v1/messages/count_tokens.

Only the top level is typed here: message content, tools and the option objects are
checked by hand (:mod:`.blocks`, :mod:`.tools`, :mod:`.validate`) so every error can
name its exact field and block types that carry no prompt meaning can be skipped.
Unknown top-level fields are ignored, as Anthropic's advisory fields are. The sampling
fields are :data:`SAMPLING`, Anthropic's spelling of :mod:`ninfer.sampling_schema`.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from ninfer.sampling_schema import Limits
from ninfer.sampling_wire import SamplingWire, WireField

#: the sampling fields of a Messages request (rules: ninfer.sampling_schema)
SAMPLING = SamplingWire(
    # absent: the server's default; 0 is refused (no zero-output cache warm-up here)
    WireField("max_tokens", limits=Limits(lo=1), absent=None),
    WireField("temperature", limits=Limits(0.0, 1.0)),
    WireField("top_p", limits=Limits(0.0, 1.0)),  # above 0, as the engine needs
    WireField("top_k"),
    WireField("stop_sequences", "stop", wire_type=Optional[list[str]]),
)


class MessagesRequest(SAMPLING.struct("MessagesSampling", module=__name__, kw_only=True), kw_only=True):
    """The sampling fields come from :data:`SAMPLING`."""

    model: Optional[str] = None
    messages: Any = None
    system: Any = None
    stream: bool = False
    thinking: Any = None
    tools: Any = None
    tool_choice: Any = None
    cache_control: Any = None
    output_config: Any = None
    #: ninfer extension: keep the reasoning of closed assistant turns in the prompt
    preserve_thinking: Optional[bool] = None
    # fields whose behaviour needs an executor ninfer lacks; rejected when set
    container: Any = None
    mcp_servers: Any = None
    output_format: Any = None


def decode_request(body: bytes) -> MessagesRequest:
    """Raises msgspec errors (answered as 400) for malformed JSON or mistyped fields."""
    return msgspec.json.decode(body, type=MessagesRequest)


class Usage(msgspec.Struct, kw_only=True):
    """Prompt tokens split into uncached and verified reused; cache writes are not measured."""

    input_tokens: int
    cache_creation_input_tokens: Optional[int] = None
    cache_read_input_tokens: int = 0
    output_tokens: int


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[str]
    stop_sequence: Optional[str]
    usage: Usage


class TokenCount(msgspec.Struct):
    input_tokens: int


encoder = msgspec.json.Encoder()
