"""A validated chat request -> the pipeline's request: conversation, tools, template options, sampling."""

from __future__ import annotations

import msgspec

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import parse_messages
from ninfer.frontend.pipeline_request import ChatPrompt, GenerateRequest, TemplateOptions
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.openai_chat.guided import answer_guide, tool_request
from ninfer_plugins.protocols.openai_chat.schema import SAMPLING, ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.validate import callable_tools
from ninfer.frontend.openai_cache_hints import has_breakpoint, implicit_breakpoint, latest_writes

#: chat_template_kwargs keys with a meaning here; other non-null keys are refused
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")
#: roles that render as tool results (legacy function results too)
_RESULTS = ("tool", "function")


def _both_spellings(req: ChatCompletionRequest, key: str) -> bool | None:
    """A top-level option and its chat_template_kwargs twin; both given must agree."""
    top = getattr(req, key)
    nested = (req.chat_template_kwargs or {}).get(key)
    if nested is not None and not isinstance(nested, bool):
        raise InvalidRequestError(f"{key} must be a boolean", param=f"chat_template_kwargs.{key}")
    if top is not None and nested is not None and top != nested:
        raise InvalidRequestError(
            f"{key} and chat_template_kwargs.{key} disagree", param=key, code="conflicting_template_option"
        )
    return top if top is not None else nested


def template_options(req: ChatCompletionRequest) -> TemplateOptions:
    """Thinking switch, effort and history reasoning as the request spells them."""
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise UnsupportedFeatureError(
                f"chat_template_kwargs.{key} is not supported (only {', '.join(TEMPLATE_KWARGS)})",
                param=f"chat_template_kwargs.{key}",
            )
    return TemplateOptions(effort=req.reasoning_effort, enable=_both_spellings(req, "enable_thinking"),
                           preserve=_both_spellings(req, "preserve_thinking"))


def chat_prompt(req: ChatCompletionRequest) -> ChatPrompt:
    """The conversation, its callable tools and the requested template options."""
    options = template_options(req)
    messages = msgspec.to_builtins(req.messages)
    turns = parse_messages(messages)
    # OpenAI prompt caching: the end of the conversation is an implicit shared-prefix
    # candidate unless prompt_cache_options asks for explicit breakpoints only
    implicit = implicit_breakpoint(req.prompt_cache_options, len(turns))
    return ChatPrompt(turns, callable_tools(req), options, cache_breakpoints=_marked_turns(messages, implicit),
                      implicit_breakpoint=implicit)


def _marked_turns(messages: list, implicit: int | None) -> tuple[int, ...]:
    """Turn counts after the messages whose parts carry a ``prompt_cache_breakpoint`` (one
    message is one turn). A tool result followed by another renders inside one message
    with it, so its mark has no exact boundary and takes no write slot."""
    counts = []
    for i, message in enumerate(messages):
        if not has_breakpoint(message.get("content")):
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if message.get("role") in _RESULTS and nxt is not None and nxt.get("role") in _RESULTS:
            continue
        counts.append(i + 1)
    return latest_writes(counts, implicit)


def generate_request(req: ChatCompletionRequest, params: SamplingParams, lora: str | None) -> GenerateRequest:
    """What the pipeline runs for a validated request (``n`` choices of one prompt)."""
    return GenerateRequest(
        [chat_prompt(req)], params, n=req.n or 1, lora=lora, tools=tool_request(req), answer=answer_guide(req),
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    )


def sampling_params(req: ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    """The engine's parameters for one choice (``n`` is expanded by the caller)."""
    values = SAMPLING.params(req, vocab_size=vocab_size)
    values.pop("n", None)
    # top_logprobs counts alternatives; only logprobs: true asks for log probabilities at all
    values["logprobs"] = (values.get("logprobs") or 0) if req.logprobs else None
    return SamplingParams(**values)
