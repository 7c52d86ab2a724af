"""Descriptor types for the capability kinds whose machinery lives in later layers.

Every capability object has a ``name`` (unique within its kind) and a one-line
``description`` shown by ``ninfer-serve --list-plugins``. Model families and KV
formats have richer descriptors next to the code that uses them
(:mod:`ninfer.model.family`, :mod:`ninfer.model.kv`).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class SpeculativeBackend:
    name: str
    description: str = ""
    #: inclusive range of ``--draft-tokens`` the backend accepts
    draft_tokens: tuple[int, int] = (1, 1)
    #: builds the proposer: ``factory(ninfer.engine.spec.proposer.ProposerContext) -> Proposer``
    factory: Callable[..., Any] | None = None
    #: ``attention_specs(model) -> [ninfer.model.interface.AttentionSpec]``: the draft
    #: layers' KV caches, allocated in the paged pool beside the target's (None: none)
    attention_specs: Callable[..., Any] | None = None
    #: the backend drafts through the target's LM head and can score a shortlist of it
    #: instead (``--lm-head-draft``)
    lm_head_draft: bool = False
    #: the proposer drafts greedily from device tensors (``draft_after_round``), so greedy
    #: rounds run whole on the device and ahead of their verdicts
    #: (ninfer.engine.spec.device_rounds)
    drafts_on_device: bool = False


@attrs.frozen
class ToolParser:
    name: str
    description: str = ""
    #: ``factory(tools, tolerant=False)`` -> :class:`ninfer.frontend.output_split.ToolCallParser`
    factory: Callable[..., Any] | None = None
    #: ``grammar(tools, mode, *, parallel=True, answer=None)`` ->
    #: :class:`ninfer.guided.spec.GuideSpec`: constrains output to this format's calls of
    #: ``tools`` (:class:`ninfer.frontend.tool_schema.ToolSpec`). ``mode`` "required": the
    #: answer is calls only; "auto": free text (or, with ``answer``, output following that
    #: json_object/json_schema guide) or calls. ``parallel`` False allows one call at most;
    #: strict tools' arguments follow their schema. None: calls of this format cannot be forced.
    grammar: Callable[..., Any] | None = None


@attrs.frozen
class ReasoningParser:
    """A model format's reasoning channel; the plugin supplies every marker (the core knows none)."""

    name: str
    description: str = ""
    #: text that opens and closes the reasoning channel
    start: str = attrs.field(kw_only=True)
    end: str = attrs.field(kw_only=True)
    #: what the engine commits when a thinking budget runs out: any guidance, then the
    #: close marker and the separator the chat format puts before the answer
    budget_close: str = attrs.field(kw_only=True)


@attrs.frozen
class Protocol:
    name: str
    description: str = ""
    #: ``routes(app_state) -> list`` of Litestar route handlers
    routes: Callable[..., list] | None = None


@attrs.frozen
class GuidedDecodingBackend:
    name: str
    description: str = ""
    #: ``factory(tokenizer, vocab_size)`` -> :class:`ninfer.guided.backend.GuideCompiler`,
    #: built once per engine (``tokenizer`` is a :class:`ninfer.tokenizer.Tokenizer`)
    factory: Callable[..., Any] | None = None
