"""Wire shapes of POST /v1/chat/completions, as msgspec structs.

Litestar decodes requests into these and builds the OpenAPI document from them.
Types are exact where the wire format is fixed; fields whose accepted values depend on
other fields (tool choice, output constraints, capability fields that are rejected when
they ask for something) are loose here and checked in :mod:`.validate` and
:mod:`.guided`, which name the field in their errors. The sampling fields come from
:data:`SAMPLING`, this API's spelling of :mod:`ninfer.sampling_schema`, which also checks
and translates them. Unknown top-level fields are ignored, as OpenAI clients expect.
Output fields typed ``... | UnsetType`` are left out of the JSON when unset.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ninfer.sampling_schema import Limits
from ninfer.sampling_wire import SamplingWire, WireField

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_TOP_K = 20
MAX_N = 16

#: the sampling fields of a chat request, in checking order; their ranges are this API's
#: contract (narrower than the engine's where they differ)
SAMPLING = SamplingWire(
    WireField("max_completion_tokens", "max_tokens", absent=None),  # absent: the server's default
    WireField("max_tokens", absent=None),  # the legacy spelling; max_completion_tokens wins
    WireField("temperature", limits=Limits(0.0, 2.0)),
    WireField("top_p", limits=Limits(0.0, 1.0)),
    WireField("top_k", limits=Limits(0, MAX_TOP_K)),
    WireField("min_p"),
    WireField("presence_penalty"),
    WireField("frequency_penalty"),
    WireField("repetition_penalty", only=1, why="only the neutral value 1 is accepted"),
    WireField("seed"),
    WireField("stop", max_items=MAX_STOP),
    WireField("n", limits=Limits(1, MAX_N)),
    WireField("top_logprobs", "logprobs", limits=Limits(0, MAX_TOP_LOGPROBS)),  # used with logprobs: true
    WireField("logit_bias"),
    # vLLM's extensions, which its OpenAI clients send in extra_body
    WireField("min_tokens"),
    WireField("ignore_eos"),
    WireField("stop_token_ids"),
)

# -- request: messages ----------------------------------------------------------------


#: a part's OpenAI prompt-cache mark, ``{"mode": "explicit"}`` (checked in .validate)
CacheBreakpoint = Optional[dict[str, Any]]


class TextPart(Struct, tag_field="type", tag="text"):
    text: str
    prompt_cache_breakpoint: CacheBreakpoint = None


class RefusalPart(Struct, tag_field="type", tag="refusal"):
    refusal: str
    prompt_cache_breakpoint: CacheBreakpoint = None


class MediaURL(Struct):
    url: str
    detail: Optional[str] = None


class ImagePart(Struct, tag_field="type", tag="image_url"):
    image_url: Union[MediaURL, str]
    prompt_cache_breakpoint: CacheBreakpoint = None


class VideoPart(Struct, tag_field="type", tag="video_url"):
    video_url: Union[MediaURL, str]
    prompt_cache_breakpoint: CacheBreakpoint = None


class AudioPart(Struct, tag_field="type", tag="input_audio"):
    input_audio: dict[str, Any]


class FilePart(Struct, tag_field="type", tag="file"):
    file: dict[str, Any]


ContentPart = Union[TextPart, RefusalPart, ImagePart, VideoPart, AudioPart, FilePart]
Content = Union[str, list[ContentPart], None]


class FunctionCall(Struct):
    name: str
    #: JSON text, or (an extension) the decoded object; member order is kept either way
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(Struct):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class SystemMessage(Struct, tag_field="role", tag="system"):
    content: Content = None
    name: Optional[str] = None


class DeveloperMessage(Struct, tag_field="role", tag="developer"):
    content: Content = None
    name: Optional[str] = None


class UserMessage(Struct, tag_field="role", tag="user"):
    content: Content = None
    name: Optional[str] = None


class AssistantMessage(Struct, tag_field="role", tag="assistant"):
    content: Content = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[FunctionCall] = None
    refusal: Optional[str] = None
    name: Optional[str] = None


class ToolMessage(Struct, tag_field="role", tag="tool"):
    content: Content = None
    tool_call_id: Optional[str] = None
    #: accepted and ignored: some clients mirror the function name onto results
    name: Optional[str] = None


class FunctionMessage(Struct, tag_field="role", tag="function"):
    name: str
    content: Content = None


Message = Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage]

# -- request: the rest ----------------------------------------------------------------


class FunctionDefinition(Struct):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Struct):
    type: str = "function"
    function: Optional[FunctionDefinition] = None


class StreamOptions(Struct):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None


class ChatCompletionRequest(SAMPLING.struct("ChatSampling", module=__name__, kw_only=True), kw_only=True):
    """The sampling fields (output budget included) come from :data:`SAMPLING`."""

    messages: list[Message]
    model: Optional[str] = None
    #: turns on log probabilities (``top_logprobs`` says how many alternatives)
    logprobs: Optional[bool] = None
    # streaming and observations
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    timings_per_token: Optional[bool] = None
    return_progress: Optional[bool] = None
    # tools
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Union[str, dict[str, Any], None] = None
    # reasoning and template options
    reasoning_effort: Optional[str] = None
    enable_thinking: Optional[bool] = None
    preserve_thinking: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # output constraints (checked and translated in .guided): OpenAI's, vLLM's, llama.cpp's
    response_format: Optional[dict[str, Any]] = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    grammar: Any = None
    structured_outputs: Any = None
    # capability fields (rejected when they ask for something we lack)
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None
    store: Optional[bool] = None
    web_search_options: Optional[dict[str, Any]] = None
    moderation: Any = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    # advisory hints (accepted, no effect on generation)
    prediction: Any = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None


# -- responses --------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class CompletionTokensDetails(Struct):
    reasoning_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class Timings(Struct):
    """llama.cpp's timing extension; rates are 0 where their denominator is 0."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    #: with speculative decoding only: tokens drafted, and how many of them were kept
    draft_n: Union[int, UnsetType] = UNSET
    draft_n_accepted: Union[int, UnsetType] = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: Optional[list[TokenLogprob]]
    refusal: Optional[list[TokenLogprob]] = None


class FunctionOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionOut
    type: Literal["function"] = "function"


class AssistantOut(Struct):
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Union[list[ToolCallOut], UnsetType] = UNSET
    refusal: None = None
    role: Literal["assistant"] = "assistant"


class Choice(Struct):
    index: int
    message: AssistantOut
    finish_reason: Optional[str]
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    timings: Timings
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: Optional[str] = None


class FunctionDelta(Struct):
    name: Union[str, UnsetType] = UNSET
    arguments: Union[str, UnsetType] = UNSET


class ToolCallDelta(Struct):
    index: int
    function: FunctionDelta
    id: Union[str, UnsetType] = UNSET
    type: Union[Literal["function"], UnsetType] = UNSET


class Delta(Struct):
    role: Union[Literal["assistant"], UnsetType] = UNSET
    content: Union[str, UnsetType] = UNSET
    reasoning_content: Union[str, UnsetType] = UNSET
    tool_calls: Union[list[ToolCallDelta], UnsetType] = UNSET


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChoiceLogprobs] = None


class PromptProgress(Struct):
    total: int
    cache: int
    processed: int
    time_ms: int


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: Optional[str] = None
    usage: Union[Usage, None, UnsetType] = UNSET
    timings: Union[Timings, UnsetType] = UNSET
    prompt_progress: Union[PromptProgress, UnsetType] = UNSET


encoder = msgspec.json.Encoder()
