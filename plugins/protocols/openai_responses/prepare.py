"""A checked request (plus its parent Response) -> the rendered prompt and its tokens.

Create and the input-token count both call :func:`prepare`, so a count is exactly the
prompt Create would run: same parent lookup, tool set, call-ID checks and template.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import jinja2

from ninfer.errors import InvalidRequestError
from ninfer.frontend.chat_messages import ChatTurn, template_messages
from ninfer.frontend.prompt_options import PromptOptions, pick_spelling, resolve_prompt_options, template_kwargs
from ninfer.frontend.template_caps import TemplateCaps, detect_caps
from ninfer_plugins.protocols.openai_responses.history import lower_items
from ninfer_plugins.protocols.openai_responses.items import Item, canonical_input
from ninfer_plugins.protocols.openai_responses.schema import PromptFields
from ninfer_plugins.protocols.openai_responses.store import StoredResponse
from ninfer_plugins.protocols.openai_responses.tools import ToolSet, resolve_tools
from ninfer_plugins.protocols.openai_responses.transcript import added_markers, encode_prompt


@attrs.frozen
class PromptContext:
    """Per-server inputs of prompt preparation."""

    tokenizer: Any
    caps: TemplateCaps
    markers: tuple[str, ...]
    thinking_default: bool
    preserve_default: bool

    @classmethod
    def of(cls, tokenizer: Any, profile: Any) -> "PromptContext":
        return cls(tokenizer, detect_caps(tokenizer.chat_template_source), added_markers(tokenizer),
                   profile.reasoning.thinking, profile.reasoning.preserve_thinking)


@attrs.frozen
class Prepared:
    prompt: str
    prompt_ids: list[int]
    options: PromptOptions
    tools: ToolSet
    #: this request's canonical input Items
    input_items: list[Item]
    #: the conversation before them (the parent's), empty without previous_response_id
    earlier: tuple[Item, ...]


def resolve_options(req: PromptFields, ctx: PromptContext, parent: Optional[StoredResponse]) -> PromptOptions:
    """Template options; an omitted preserve_thinking is inherited from the parent Response."""
    kwargs = req.chat_template_kwargs or {}
    enable = pick_spelling({"chat_template_kwargs.enable_thinking": kwargs.get("enable_thinking")},
                           "enable_thinking")
    preserve = pick_spelling({"preserve_thinking": req.preserve_thinking,
                              "chat_template_kwargs.preserve_thinking": kwargs.get("preserve_thinking")},
                             "preserve_thinking")
    return resolve_prompt_options(
        ctx.caps,
        effort=req.reasoning.effort if req.reasoning is not None else None,
        enable=enable,
        preserve=preserve,
        thinking_default=ctx.thinking_default,
        preserve_default=parent.preserve_thinking if parent is not None else ctx.preserve_default,
        effort_param="reasoning.effort",
    )


def prepare(req: PromptFields, ctx: PromptContext, parent: Optional[StoredResponse], store: bool) -> Prepared:
    """Render and tokenize (blocking: run it off the event loop)."""
    options = resolve_options(req, ctx, parent)
    tools = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    items = canonical_input(req.input, has_parent=parent is not None, unique_ids=store)
    earlier = parent.conversation if parent is not None else ()
    located = [(item, "previous_response_id") for item in earlier]
    located += [(item, f"input[{i}]") for i, item in enumerate(items)]
    turns = lower_items(located)
    if req.instructions:
        turns.insert(0, ChatTurn("developer", req.instructions))
    try:
        prompt = ctx.tokenizer.apply_chat_template(
            template_messages(turns), tools=tools.definitions or None, add_generation_prompt=True,
            **template_kwargs(options, ctx.caps),
        )
    except jinja2.TemplateError as exc:  # the template itself refused this conversation
        raise InvalidRequestError(f"the chat template cannot render this conversation: {exc}", param="input",
                                  code="invalid_prompt") from exc
    transcript = parent.transcript if parent is not None else None
    ids = encode_prompt(prompt, ctx.tokenizer, ctx.markers, transcript)
    return Prepared(prompt, ids, options, tools, items, earlier)
