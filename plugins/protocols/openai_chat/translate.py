"""A validated chat request -> prompt text, token ids, sampling parameters and thinking mode."""

from __future__ import annotations

from typing import Any

import attrs
import jinja2
import msgspec

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import parse_messages, template_messages
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.openai_chat.schema import ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.validate import callable_tools

#: every effort value of the OpenAI protocol; which ones work depends on the template
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: chat_template_kwargs keys with a meaning here; other non-null keys are refused
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")


@attrs.frozen
class PromptOptions:
    """Resolved template options: ``effort`` is None when the template default applies."""

    thinking: bool
    preserve_thinking: bool
    effort: str | None


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
    """Thinking switch, effort and history reasoning from the request, the template and the server.

    A template without a thinking switch renders the same prompt whatever the request
    says, so the server default decides its thinking mode.
    """
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise UnsupportedFeatureError(
                f"chat_template_kwargs.{key} is not supported (only {', '.join(TEMPLATE_KWARGS)})",
                param=f"chat_template_kwargs.{key}",
            )
    enable = _both_spellings(req, "enable_thinking")
    preserve = _both_spellings(req, "preserve_thinking")
    effort = req.reasoning_effort
    if effort is not None:
        if effort not in EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(EFFORTS)}", param="reasoning_effort")
        if effort != "none" and effort not in caps.efforts:
            offered = ", ".join(("none", *caps.efforts))
            raise InvalidRequestError(
                f"reasoning_effort {effort!r} is not offered by the loaded chat template (it offers: {offered})",
                param="reasoning_effort",
                code="reasoning_effort_not_supported",
            )
        if enable is not None and enable != (effort != "none"):
            raise InvalidRequestError(
                f"reasoning_effort {effort!r} contradicts enable_thinking={str(enable).lower()}",
                param="reasoning_effort",
                code="conflicting_template_option",
            )
        enable = effort != "none"
    if preserve and not caps.preserve_thinking:
        raise UnsupportedFeatureError(
            "preserve_thinking: the loaded chat template cannot keep earlier turns' reasoning",
            param="preserve_thinking",
        )
    thinking = enable if enable is not None and caps.enable_thinking else thinking_default
    return PromptOptions(
        thinking=thinking,
        preserve_thinking=preserve_default if preserve is None else preserve,
        effort=effort if effort not in (None, "none") else None,
    )


def template_kwargs(options: PromptOptions, caps: TemplateCaps) -> dict[str, Any]:
    """Only variables the template reads: others would be silently meaningless."""
    kwargs: dict[str, Any] = {}
    if caps.enable_thinking:
        kwargs["enable_thinking"] = options.thinking
    if caps.preserve_thinking:
        kwargs["preserve_thinking"] = options.preserve_thinking
    if options.effort is not None:
        kwargs["reasoning_effort"] = options.effort
    return kwargs


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
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = {int(k): v for k, v in (req.logit_bias or {}).items() if v != 0}
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        stop=stop,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logit_bias=bias,
    )
    params.validate(vocab_size)
    return params
