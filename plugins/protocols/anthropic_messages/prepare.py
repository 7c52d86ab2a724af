"""A Messages request -> the pipeline's request (:func:`lower`), and the prompt a count reports.

Generation and token counting lower the same way and render through the pipeline
(:meth:`ninfer.frontend.pipeline.Pipeline.render`), so a count always equals the prompt
the same request runs with. Anthropic's thinking and effort fields are translated into
the pipeline's :class:`TemplateOptions` here; checking them against the template and
filling in the server's defaults is the pipeline's. Blocking (template rendering,
tokenizing): run it off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ninfer.errors import InvalidRequestError
from ninfer.frontend.chat_messages import ChatTurn
from ninfer.frontend.pipeline_request import ChatPrompt, GenerateRequest, TemplateOptions, ThinkingRequest
from ninfer.frontend.tool_guide import ToolRequest
from ninfer.guided.spec import GuideSpec
from ninfer.sampling_params import SamplingParams
from ninfer_plugins.protocols.anthropic_messages.blocks import consume_billing, lower_messages, system_text
from ninfer_plugins.protocols.anthropic_messages.cache import breakpoint_turns, check_cache_control
from ninfer_plugins.protocols.anthropic_messages.guided import answer_guide
from ninfer_plugins.protocols.anthropic_messages.schema import MessagesRequest
from ninfer_plugins.protocols.anthropic_messages.tools import parse_tool_choice, template_tools, tool_request
from ninfer_plugins.protocols.anthropic_messages.validate import (
    ThinkingConfig,
    check_unsupported,
    parse_thinking,
    requested_effort,
)

if TYPE_CHECKING:
    from ninfer.frontend.pipeline import Pipeline, Rendered


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


def lower(req: MessagesRequest, max_tokens: Optional[int]) -> Lowered:
    """Validate and lower the conversation, tools and thinking options (Anthropic's rules).

    ``max_tokens``: the output limit an enabled thinking budget must stay under (None,
    when counting without one: unchecked).
    """
    check_unsupported(req)
    effort = requested_effort(req.output_config)
    config = parse_thinking(req.thinking, max_tokens)
    tools = template_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice)
    callable_tools = tools if choice.enabled else []
    answer = answer_guide(req)
    system, consumed = consume_billing(req.system)
    targets = check_cache_control(req.cache_control, req.system, consumed, req.messages, req.tools)
    lowered = lower_messages(req.messages)
    turns = lowered.turns
    if system is not None:
        text = system_text(system, start=consumed)
        if text:
            turns = [ChatTurn("system", text), *turns]
    breakpoints = breakpoint_turns(targets, lowered.message_turns, len(turns) - len(lowered.turns))
    options = template_options(config, effort, req.preserve_thinking, lowered.prefill)
    prompt = ChatPrompt(turns, callable_tools, options, continue_final=lowered.prefill, cache_breakpoints=breakpoints)
    enabled = config.mode == "enabled"
    # enabled thinking uses the request's budget (lowered to fit, as Claude Code sends 31999 of
    # 32000), otherwise the server default applies with the strict check
    budget = ThinkingRequest(config.budget if enabled else None, "thinking.budget_tokens", fit=True)
    return Lowered(prompt, tool_request(req.tools, tools, choice), answer, budget)


def generate_request(req: MessagesRequest, params: SamplingParams, lora: Optional[str], request_id: str,
                     max_tokens: int) -> GenerateRequest:
    """What the pipeline runs for ``req`` (blocking: the pipeline calls it off the loop)."""
    return lower(req, max_tokens).generate_request(params, lora, request_id)


def count(req: MessagesRequest, pipeline: Pipeline) -> Rendered:
    """The prompt ``req`` runs with; it may exceed the context (clients count to decide what to cut)."""
    return pipeline.render(lower(req, req.max_tokens).prompt)


def template_options(config: ThinkingConfig, effort: Optional[str], preserve: Optional[bool],
                     prefill: bool) -> TemplateOptions:
    """Anthropic's thinking modes: an omitted mode is the server's default; a prefill is
    continued without thinking; an effort applies only while thinking, switching nothing."""
    if prefill and config.mode in ("enabled", "adaptive"):
        raise InvalidRequestError("an assistant prefill cannot be continued with thinking enabled",
                                  param="thinking.type")
    enable = None if config.mode is None else config.mode != "disabled"
    return TemplateOptions(effort=effort, enable=enable, preserve=preserve, effort_param="output_config.effort",
                           effort_enables=False, thinking_default=False if prefill else None)
