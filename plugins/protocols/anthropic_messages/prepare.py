"""A validated Messages request -> prompt text, token ids, thinking mode and thinking budget.

Generation and token counting share this path, so a count always equals the prompt the
same request runs with. Blocking (template rendering, tokenizing): run it off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jinja2

from ninfer.capabilities import ReasoningParser, ToolParser
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.frontend.chat_messages import ChatTurn, template_messages
from ninfer.frontend.parsers import starts_in_reasoning
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer.frontend.thinking import thinking_budget
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.protocols.anthropic_messages.blocks import consume_billing, lower_messages, system_text
from ninfer_plugins.protocols.anthropic_messages.cache import check_cache_control
from ninfer_plugins.protocols.anthropic_messages.guided import answer_guide
from ninfer_plugins.protocols.anthropic_messages.schema import MessagesRequest
from ninfer_plugins.protocols.anthropic_messages.tools import parse_tool_choice, template_tools, tool_request
from ninfer_plugins.protocols.anthropic_messages.validate import (
    ThinkingConfig,
    check_unsupported,
    parse_thinking,
    requested_effort,
)
from ninfer.frontend.tool_guide import request_guide


@dataclass(frozen=True)
class Context:
    """What preparation needs from the server, fixed for its lifetime."""

    tokenizer: Any
    profile: Any
    parser: Optional[ReasoningParser]
    max_context: int
    #: writes the grammar of forced, single or strict tool calls
    tool_parser: Optional[ToolParser] = None


@dataclass(frozen=True)
class Prepared:
    prompt: str
    prompt_ids: list[int]
    thinking: bool
    #: callable tool definitions (rendered into the prompt)
    tools: list[dict[str, Any]]
    prefill: bool
    budget: Optional[ThinkingBudget] = None
    #: what the output must follow (structured output, forced or strict tool calls)
    guide: Optional[GuideSpec] = None


def prepare(req: MessagesRequest, ctx: Context, generate: bool = True) -> Prepared:
    """Validate, render and tokenize; with ``generate`` also fix the output and thinking budgets
    and the output guide."""
    check_unsupported(req)
    caps = detect_caps(ctx.tokenizer.chat_template_source)
    effort = requested_effort(req.output_config, caps)
    default_max = ctx.profile.engine.default_max_tokens
    config = parse_thinking(req.thinking, (req.max_tokens or default_max) if generate else req.max_tokens)
    tools = template_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice)
    callable_tools = tools if choice.enabled else []
    answer = answer_guide(req)
    system, consumed = consume_billing(req.system)
    check_cache_control(req.cache_control, req.system, consumed, req.messages, req.tools)
    lowered = lower_messages(req.messages)
    turns = lowered.turns
    if system is not None:
        text = system_text(system, start=consumed)
        if text:
            turns = [ChatTurn("system", text), *turns]
    thinking = _thinking(config, caps, ctx.profile.reasoning.thinking, lowered.prefill)
    kwargs = _template_kwargs(req, caps, thinking, effort, ctx.profile.reasoning.preserve_thinking)
    try:
        prompt = ctx.tokenizer.apply_chat_template(
            template_messages(turns), tools=callable_tools or None, continue_final_message=lowered.prefill, **kwargs
        )
    except (jinja2.TemplateError, ValueError) as exc:  # the template refused, or dropped the prefill text
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}", param="messages",
                                  code="invalid_prompt") from exc
    ids = ctx.tokenizer.encode(prompt)
    if generate:  # a count may exceed it: clients count to decide what to cut
        check_prompt_length(len(ids), ctx.max_context)
    budget = guide = None
    if generate:  # a count needs no grammar: it is what a later Create compiles
        guide = request_guide(tool_request(req.tools, tools, choice), answer, ctx.tool_parser)
    if generate and thinking:
        # the output budget the engine will apply: the request's, or the default fitted to the context
        room = req.max_tokens if req.max_tokens is not None else max(min(default_max, ctx.max_context - len(ids)), 0)
        budget = _budget(ctx, config, prompt, room)
    return Prepared(prompt, ids, thinking, callable_tools, lowered.prefill, budget, guide)


def _thinking(config: ThinkingConfig, caps: TemplateCaps, default: bool, prefill: bool) -> bool:
    """The request's mode where the template can switch; a prefill is continued without thinking."""
    if prefill and config.mode in ("enabled", "adaptive"):
        raise InvalidRequestError("an assistant prefill cannot be continued with thinking enabled",
                                  param="thinking.type")
    if config.mode is None or not caps.enable_thinking:
        return default and not prefill
    return config.mode != "disabled"


def _template_kwargs(req: MessagesRequest, caps: TemplateCaps, thinking: bool, effort: Optional[str],
                     preserve_default: bool) -> dict[str, Any]:
    """Only variables the template reads."""
    if req.preserve_thinking and not caps.preserve_thinking:
        raise UnsupportedFeatureError("the loaded chat template cannot keep earlier turns' reasoning",
                                      param="preserve_thinking")
    kwargs: dict[str, Any] = {}
    if caps.enable_thinking:
        kwargs["enable_thinking"] = thinking
    if caps.preserve_thinking:
        kwargs["preserve_thinking"] = preserve_default if req.preserve_thinking is None else req.preserve_thinking
    if effort is not None and thinking:
        kwargs["reasoning_effort"] = effort
    return kwargs


def _budget(ctx: Context, config: ThinkingConfig, prompt: str, room: int) -> Optional[ThinkingBudget]:
    """Enabled thinking uses the request's budget, otherwise the server default applies.

    A request budget so close to max_tokens that the close sequence plus one answer
    token cannot follow it (Claude Code sends 31999 of 32000) is lowered until they fit,
    so the request runs instead of failing; a server default keeps the strict check.
    """
    cap = config.budget if config.mode == "enabled" else ctx.profile.reasoning.default_thinking_budget
    if cap is None or ctx.parser is None:
        return None
    open_at_start = starts_in_reasoning(prompt, ctx.parser)
    if config.mode == "enabled":
        # the close sequence, one answer token, and the opener when the model emits it
        need = len(ctx.tokenizer.encode(ctx.parser.budget_close)) + 1 + (0 if open_at_start else 1)
        if cap < room < cap + need:
            cap = room - need if room > need else None
    param = "thinking.budget_tokens" if config.mode == "enabled" else "max_tokens"
    return thinking_budget(ctx.tokenizer, ctx.parser, cap, room, open_at_start, param=param)
