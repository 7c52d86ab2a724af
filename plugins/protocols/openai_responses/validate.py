"""Field checks the request structs cannot express.

Each rejection names its field. Capability fields fail only when they ask for
behaviour this server cannot provide; their neutral values pass, so clients that send
defaults keep working.
"""

from __future__ import annotations

from typing import Any, Optional

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.sampling_params import SamplingParams
from ninfer.frontend.openai_cache_hints import check_cache_hints
from ninfer_plugins.protocols.openai_responses.guided import text_format_guide
from ninfer_plugins.protocols.openai_responses.schema import SAMPLING, CountRequest, CreateRequest, PromptFields

#: the one ``include`` value honoured: reasoning Items carry a replayable envelope
ENCRYPTED_REASONING = "reasoning.encrypted_content"
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")
SUMMARIES = ("auto", "concise", "detailed", "none")
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: recognised Create fields whose every non-null value asks for something unsupported
_REFUSED = {
    "conversation": "Conversations are not supported; chain Responses with previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "context_management": "server-side context management is not supported",
    "moderation": "moderation is not supported",
    "background_options": "background execution is not supported",
    "access_programs": "programmatic tool access is not supported",
    "image": "image generation is not supported",
    "personality": "personalities are not supported",
}


def _unsupported(param: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{param}: {what}", param=param)


def check_prompt_fields(req: PromptFields) -> None:
    """Checks shared by Create and the input-token count."""
    for name, what in _REFUSED.items():
        if getattr(req, name, None) is not None:
            raise _unsupported(name, what)
    text = req.text
    if text is not None:
        text_format_guide(text)  # shape only; the schema is compiled for Create
        if text.verbosity not in (None, "medium"):
            raise _unsupported("text.verbosity", "only the default verbosity (medium) is supported")
    if req.truncation not in (None, "disabled"):
        if req.truncation == "auto":
            raise _unsupported("truncation", "overlong input fails instead of dropping Items")
        raise InvalidRequestError("truncation must be auto or disabled", param="truncation")
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise _unsupported(f"chat_template_kwargs.{key}", f"only {', '.join(TEMPLATE_KWARGS)} are supported")
    reasoning = req.reasoning
    for key in ("summary", "generate_summary"):
        value = getattr(reasoning, key) if reasoning is not None else None
        if value is not None and value not in SUMMARIES:
            raise InvalidRequestError(f"reasoning.{key} must be one of {', '.join(SUMMARIES)}",
                                      param=f"reasoning.{key}")


def check_count(req: CountRequest) -> None:
    check_prompt_fields(req)


def check_create(req: CreateRequest) -> None:
    check_prompt_fields(req)
    SAMPLING.check(req)
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        raise InvalidRequestError("max_tool_calls must be >= 0", param="max_tool_calls")
    if req.background:
        raise _unsupported("background", "background execution is not supported")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "only the default service tier exists here")
    for entry in req.include or []:
        if entry != ENCRYPTED_REASONING:
            raise _unsupported("include", f"{entry!r} cannot be included (only {ENCRYPTED_REASONING})")
    _check_metadata(req.metadata)
    check_cache_hints(req.prompt_cache_retention, req.prompt_cache_options)


def sampling_params(req: CreateRequest, vocab_size: int) -> SamplingParams:
    """The engine's parameters (``max_output_tokens`` absent: the server's default)."""
    return SamplingParams(**SAMPLING.params(req, vocab_size=vocab_size))


def _check_metadata(metadata: Optional[dict[str, Any]]) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise InvalidRequestError(f"metadata holds at most {MAX_METADATA} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequestError(f"metadata keys are at most {MAX_METADATA_KEY} characters",
                                      param=f"metadata.{key}")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(f"metadata values are strings of at most {MAX_METADATA_VALUE} characters",
                                      param=f"metadata.{key}")
