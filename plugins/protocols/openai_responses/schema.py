"""Request bodies of the Responses endpoints, as msgspec structs.

Top-level members are closed: a field this server does not know fails with
``unknown_parameter`` rather than being dropped silently. Input Items, tools and tool
choices stay plain JSON (member order kept) and are checked by hand in
:mod:`.items` and :mod:`.tools`, so every error can name the exact path. Nested option
objects (``reasoning``, ``text``, ...) ignore members they do not define.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
from msgspec import Struct

from ninfer.errors import InvalidRequestError
from ninfer.sampling_schema import Limits
from ninfer.sampling_wire import SamplingWire, WireField

#: the sampling fields of Create, as Responses spells them (rules: ninfer.sampling_schema)
SAMPLING = SamplingWire(
    WireField("max_output_tokens", "max_tokens", absent=None),  # absent: the server's default
    WireField("temperature", limits=Limits(0.0, 2.0)),
    WireField("top_p", limits=Limits(0.0, 1.0)),
    WireField("top_logprobs", "logprobs", only=0, why="log probabilities are not supported"),
)


class ReasoningOptions(Struct):
    effort: Optional[str] = None
    #: reasoning summaries are not produced; any valid value is accepted
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class TextOptions(Struct):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None


class StreamOptions(Struct):
    include_obfuscation: Optional[bool] = None


class PromptFields(Struct, forbid_unknown_fields=True):
    """What shapes the prompt: shared by Create and the input-token count."""

    model: Optional[str] = None
    input: Union[str, list[Any], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    reasoning: Optional[ReasoningOptions] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    truncation: Optional[str] = None
    preserve_thinking: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # recognised, refused when they ask for something
    conversation: Any = None
    prompt: Any = None


_Sampled = SAMPLING.struct("ResponsesSampling", base=PromptFields, module=__name__, forbid_unknown_fields=True)


class CreateRequest(_Sampled, forbid_unknown_fields=True):
    """The prompt fields, the sampling fields of :data:`SAMPLING`, and these."""

    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    max_tool_calls: Optional[int] = None
    service_tier: Optional[str] = None
    background: Optional[bool] = None
    # advisory hints
    client_metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    user: Optional[str] = None
    # recognised, refused when they ask for something
    context_management: Any = None
    moderation: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None


class CountRequest(PromptFields, forbid_unknown_fields=True):
    personality: Any = None


_UNKNOWN = "Object contains unknown field `"


def decode(body: bytes, kind: type[Struct]) -> Any:
    """The body as ``kind``; an unknown top-level member is ``unknown_parameter``.

    Other shape errors propagate as msgspec errors, which the server maps to 400s
    naming the field.
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith(_UNKNOWN) and message.endswith("`"):
            name = message[len(_UNKNOWN):-1]
            raise InvalidRequestError(f"unknown parameter {name!r}", param=name, code="unknown_parameter") from None
        raise
