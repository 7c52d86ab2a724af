"""A checked request (plus its parent Response) -> the pipeline's prompt (:func:`lower`).

Create hands :func:`lower` to the pipeline; the input-token count calls :func:`prepare`,
which lowers the same way and renders through the pipeline, so a count is exactly the
prompt Create would run: same parent lookup, tool set, call-ID checks and template. The
request's template options are only translated here; the pipeline resolves them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import attrs

from ninfer.frontend.chat_messages import ChatTurn
from ninfer.frontend.pipeline_request import ChatPrompt
from ninfer.frontend.prompt_options import PromptOptions, TemplateOptions, pick_spelling
from ninfer.frontend.openai_cache_hints import (
    MAX_CACHE_WRITES,
    has_breakpoint,
    implicit_breakpoint,
    latest_writes,
)
from ninfer_plugins.protocols.openai_responses.history import lower_items
from ninfer_plugins.protocols.openai_responses.items import Item, canonical_input
from ninfer_plugins.protocols.openai_responses.schema import PromptFields
from ninfer_plugins.protocols.openai_responses.store import StoredResponse
from ninfer_plugins.protocols.openai_responses.tools import ToolSet, resolve_tools
from ninfer_plugins.protocols.openai_responses.transcript import added_markers, encode_prompt

if TYPE_CHECKING:
    from ninfer.frontend.pipeline import Pipeline


@attrs.frozen
class PromptContext:
    """Per-server inputs of prompt preparation."""

    pipeline: Pipeline
    markers: tuple[str, ...]

    @classmethod
    def of(cls, pipeline: Pipeline) -> "PromptContext":
        return cls(pipeline, added_markers(pipeline.tokenizer))

    @property
    def tokenizer(self) -> Any:
        return self.pipeline.tokenizer


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


def template_options(req: PromptFields, parent: Optional[StoredResponse]) -> TemplateOptions:
    """The request's spellings of the template options; an omitted preserve_thinking is
    inherited from the parent Response."""
    kwargs = req.chat_template_kwargs or {}
    enable = pick_spelling({"chat_template_kwargs.enable_thinking": kwargs.get("enable_thinking")},
                           "enable_thinking")
    preserve = pick_spelling({"preserve_thinking": req.preserve_thinking,
                              "chat_template_kwargs.preserve_thinking": kwargs.get("preserve_thinking")},
                             "preserve_thinking")
    return TemplateOptions(effort=req.reasoning.effort if req.reasoning is not None else None, enable=enable,
                           preserve=preserve, effort_param="reasoning.effort",
                           preserve_default=parent.preserve_thinking if parent is not None else None)


@attrs.frozen
class Lowered:
    """A request's conversation as the pipeline renders it, with what the Response keeps."""

    prompt: ChatPrompt
    tools: ToolSet
    input_items: list[Item]
    earlier: tuple[Item, ...]


def explicit_breakpoints(raw: Any, located: list, first_input: int, offset: int,
                         implicit: Optional[int]) -> tuple[int, ...]:
    """Turn counts after this request's input Items that carry a ``prompt_cache_breakpoint``
    part: the latest ones, as many as fit beside the implicit candidate (which takes a slot
    unless it is one of them). An Item the next one joins into the same rendered turn ends
    no turn, so its mark has no exact boundary and is left out; so are the parent
    Response's historical marks. ``offset``: turns rendered before the Items (instructions)."""
    if not isinstance(raw, list):
        return ()
    marked = [i for i, entry in enumerate(raw) if isinstance(entry, dict) and has_breakpoint(entry.get("content"))]
    counts: list[int] = []
    for i in reversed(marked):  # the latest first: no more than MAX_CACHE_WRITES can be kept
        if len(counts) == MAX_CACHE_WRITES:
            break
        end = first_input + i + 1
        turns = len(lower_items(located[:end]))
        if end < len(located) and len(lower_items(located[: end + 1])) == turns:
            continue
        counts.append(turns + offset)
    return latest_writes(counts, implicit)


def lower(req: PromptFields, ctx: PromptContext, parent: Optional[StoredResponse], store: bool) -> Lowered:
    """Options, tools and the whole conversation (the parent's, then this input)."""
    options = template_options(req, parent)
    tools = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    items = canonical_input(req.input, has_parent=parent is not None, unique_ids=store)
    earlier = parent.conversation if parent is not None else ()
    located = [(item, "previous_response_id") for item in earlier]
    located += [(item, f"input[{i}]") for i, item in enumerate(items)]
    turns = lower_items(located)
    if req.instructions:
        turns.insert(0, ChatTurn("developer", req.instructions))
    transcript = parent.transcript if parent is not None else None
    # a continuation keeps its parent's exact tokens where the re-rendered prompt allows
    encode = partial(encode_prompt, tokenizer=ctx.tokenizer, markers=ctx.markers, parent=transcript)
    # OpenAI prompt caching: unless the request asks for explicit breakpoints only, the end
    # of the conversation is an implicit shared-prefix candidate
    implicit = implicit_breakpoint(getattr(req, "prompt_cache_options", None), len(turns))
    marks = explicit_breakpoints(req.input, located, len(earlier), 1 if req.instructions else 0, implicit)
    prompt = ChatPrompt(turns, tools.definitions, options, encode=encode, param="input", what="this conversation",
                        cache_breakpoints=marks, implicit_breakpoint=implicit)
    return Lowered(prompt, tools, items, earlier)


def prepare(req: PromptFields, ctx: PromptContext, parent: Optional[StoredResponse], store: bool) -> Prepared:
    """Lower and render the way the pipeline does (blocking: run it off the event loop)."""
    lowered = lower(req, ctx, parent, store)
    rendered = ctx.pipeline.render(lowered.prompt)
    return Prepared(rendered.text, rendered.token_ids, rendered.options, lowered.tools, lowered.input_items,
                    lowered.earlier)
