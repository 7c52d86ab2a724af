"""A validated chat request -> prompt text, token ids, sampling parameters and thinking mode."""

from __future__ import annotations

from typing import Any

import attrs
import jinja2
import msgspec

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import parse_messages, template_messages
from ninfer.frontend.prompt_options import PromptOptions, resolve_prompt_options, template_kwargs
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.openai_chat.schema import SAMPLING, ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.validate import callable_tools

#: chat_template_kwargs keys with a meaning here; other non-null keys are refused
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")


@attrs.frozen
class Prepared:
    prompt: str
    prompt_ids: list[int]
    options: PromptOptions
    #: effective tool definitions (rendered into the prompt; the only callable ones)
    tools: list[dict[str, Any]]


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


def resolve_options(req: ChatCompletionRequest, caps: TemplateCaps, thinking_default: bool,
                    preserve_default: bool) -> PromptOptions:
    """Thinking switch, effort and history reasoning from the request, the template and the server."""
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise UnsupportedFeatureError(
                f"chat_template_kwargs.{key} is not supported (only {', '.join(TEMPLATE_KWARGS)})",
                param=f"chat_template_kwargs.{key}",
            )
    return resolve_prompt_options(
        caps,
        effort=req.reasoning_effort,
        enable=_both_spellings(req, "enable_thinking"),
        preserve=_both_spellings(req, "preserve_thinking"),
        thinking_default=thinking_default,
        preserve_default=preserve_default,
    )


def prepare(req: ChatCompletionRequest, tokenizer: Any, profile: Any) -> Prepared:
    """Render and tokenize the prompt (blocking: run it off the event loop)."""
    caps = detect_caps(tokenizer.chat_template_source)
    options = resolve_options(req, caps, profile.reasoning.thinking, profile.reasoning.preserve_thinking)
    turns = parse_messages(msgspec.to_builtins(req.messages))
    tools = callable_tools(req)
    try:
        prompt = tokenizer.apply_chat_template(
            template_messages(turns), tools=tools or None, add_generation_prompt=True,
            **template_kwargs(options, caps),
        )
    except jinja2.TemplateError as exc:  # the template itself refused this conversation
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}", param="messages",
                                  code="invalid_prompt") from exc
    return Prepared(prompt, tokenizer.encode(prompt), options, tools)


def sampling_params(req: ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    """The engine's parameters for one choice (``n`` is expanded by the caller)."""
    values = SAMPLING.params(req, vocab_size=vocab_size)
    values.pop("n", None)
    # top_logprobs counts alternatives; only logprobs: true asks for log probabilities at all
    values["logprobs"] = (values.get("logprobs") or 0) if req.logprobs else None
    return SamplingParams(**values)
