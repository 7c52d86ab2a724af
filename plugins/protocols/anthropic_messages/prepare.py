"""A Messages request -> the pipeline's request (:func:`lower`), and the prompt a count reports.

Generation and token counting lower and render the same way (the pipeline's
:func:`ninfer.frontend.pipeline.render_prompt`), so a count always equals the prompt the
same request runs with. Blocking (template rendering, tokenizing): run it off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ninfer.capabilities import ReasoningParser, ToolParser
from ninfer.engine.thinking_budget import ThinkingBudget
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import ChatTurn
from ninfer.frontend.pipeline import choose_thinking_budget, output_guide, render_prompt
from ninfer.frontend.pipeline_request import ChatPrompt, GenerateRequest, ThinkingRequest
from ninfer.frontend.prompt_limits import check_prompt_length
from ninfer.frontend.prompt_options import PromptOptions
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer.frontend.tool_guide import ToolRequest
from ninfer.guided.spec import GuideSpec
from ninfer.sampling_params import SamplingParams
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
class Lowered:
    """A Messages request in the pipeline's terms (the prompt still to render)."""

    prompt: ChatPrompt
    tools: ToolRequest
    answer: Optional[GuideSpec]
    thinking: ThinkingRequest

    @property
    def prefill(self) -> bool:
        return self.prompt.continue_final

    def generate_request(self, params: SamplingParams, lora: Optional[str], request_id: str) -> GenerateRequest:
        return GenerateRequest([self.prompt], params, lora=lora, tools=self.tools, answer=self.answer,
                               thinking=self.thinking, request_id=request_id)


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


def lower(req: MessagesRequest, ctx: Context, generate: bool = True) -> Lowered:
    """Validate and lower the conversation, tools and thinking options (Anthropic's rules)."""
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
    options = _options(req, caps, thinking, effort, ctx.profile.reasoning.preserve_thinking)
    prompt = ChatPrompt(turns, callable_tools, options, continue_final=lowered.prefill)
    enabled = config.mode == "enabled"
    # enabled thinking uses the request's budget (lowered to fit, as Claude Code sends 31999 of
    # 32000), otherwise the server default applies with the strict check
    budget = ThinkingRequest(config.budget if enabled else None, "thinking.budget_tokens", fit=True)
    return Lowered(prompt, tool_request(req.tools, tools, choice), answer, budget)


def prepare(req: MessagesRequest, ctx: Context, generate: bool = True) -> Prepared:
    """Lower and render exactly as the pipeline would; with ``generate`` also the prompt-length
    check, the output guide and the thinking budget (blocking)."""
    lowered = lower(req, ctx, generate)
    rendered = render_prompt(lowered.prompt, ctx.tokenizer, ctx.profile)
    budget = guide = None
    if generate:  # a count may exceed the context (clients count to decide what to cut) and needs no grammar
        check_prompt_length(len(rendered.token_ids), ctx.max_context)
        request = lowered.generate_request(SamplingParams(max_tokens=req.max_tokens), None, "")
        guide = output_guide(request, ctx.tool_parser)
        budget = choose_thinking_budget(ctx.tokenizer, ctx.parser, ctx.profile, ctx.max_context, request, rendered)
    return Prepared(rendered.text, rendered.token_ids, bool(rendered.thinking), list(rendered.tools),
                    lowered.prefill, budget, guide)


def _thinking(config: ThinkingConfig, caps: TemplateCaps, default: bool, prefill: bool) -> bool:
    """The request's mode where the template can switch; a prefill is continued without thinking."""
    if prefill and config.mode in ("enabled", "adaptive"):
        raise InvalidRequestError("an assistant prefill cannot be continued with thinking enabled",
                                  param="thinking.type")
    if config.mode is None or not caps.enable_thinking:
        return default and not prefill
    return config.mode != "disabled"


def _options(req: MessagesRequest, caps: TemplateCaps, thinking: bool, effort: Optional[str],
             preserve_default: bool) -> PromptOptions:
    """Resolved template options: an effort counts only while thinking."""
    if req.preserve_thinking and not caps.preserve_thinking:
        raise UnsupportedFeatureError("the loaded chat template cannot keep earlier turns' reasoning",
                                      param="preserve_thinking")
    preserve = preserve_default if req.preserve_thinking is None else req.preserve_thinking
    return PromptOptions(thinking, preserve, effort if thinking else None)
