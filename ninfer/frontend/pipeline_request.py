"""What a protocol extracts from its wire body for :class:`ninfer.frontend.pipeline.Pipeline`.

A protocol lowers its own message and tool spellings; everything from admission on
(rendering, the guide, the thinking budget, the engine requests, per-choice output and
usage) is the pipeline's. The ``*_param`` fields are the wire names the pipeline's
errors blame, since each protocol spells its fields differently.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import attrs

from ninfer.frontend.chat_messages import ChatTurn
from ninfer.frontend.prompt_options import TemplateOptions
from ninfer.frontend.tool_guide import ToolRequest
from ninfer.guided.spec import GuideSpec
from ninfer.sampling_params import SamplingParams


@attrs.frozen
class ChatPrompt:
    """A conversation to render with the chat template."""

    turns: Sequence[ChatTurn]
    #: template-shaped function tools: rendered into the prompt, and the only callable ones
    tools: Sequence[dict[str, Any]] = ()
    #: requested options, checked against the template when the pipeline renders
    options: TemplateOptions = TemplateOptions()
    #: leave the last (assistant) message open instead of starting a new turn (a prefill)
    continue_final: bool = False
    #: open the assistant turn after the conversation (False: render the history only)
    add_generation_prompt: bool = True
    #: tokenizes the rendered text instead of the tokenizer (a protocol reusing stored tokens)
    encode: Optional[Callable[[str], list[int]]] = None
    #: the field a template refusal blames, and how its message names the conversation
    param: str = "messages"
    what: str = "these messages"
    #: boundaries the client asked to share, as turn counts: k is "after the first k turns"
    #: (Anthropic cache_control, OpenAI prompt-cache candidates; ninfer.frontend.cache_hints)
    cache_breakpoints: tuple[int, ...] = ()
    #: OpenAI's automatic prompt-cache candidate, as a turn count (None: none); it gives way
    #: to the marked ones when the shared-prefix limit is reached
    implicit_breakpoint: Optional[int] = None


@attrs.frozen
class TextPrompt:
    """A raw prompt: text (tokenized as is) or token ids (decoded for its text unless given)."""

    text: Optional[str] = None
    token_ids: Optional[Sequence[int]] = None
    #: whether the model is taken to be thinking (None: the process default)
    thinking: Optional[bool] = None


Prompt = Union[ChatPrompt, TextPrompt]


@attrs.frozen
class ThinkingRequest:
    """The request's own reasoning cap; absent, the server's ``--default-thinking-budget`` applies."""

    budget: Optional[int] = None
    #: the field that set ``budget``
    param: str = "thinking"
    #: lower a cap that leaves no room for the close sequence and one answer token
    #: (instead of refusing the request): clients that send a budget just under max_tokens
    fit: bool = False


@attrs.frozen
class CachePolicy:
    """Whether a request reuses and publishes prefix-cache pages (the batch format sets these)."""

    lookup: bool = True
    commit: bool = True
    #: publish the generated tokens' pages too, not only the prompt's
    commit_generated: bool = True
    #: the prompt replays a stored response (Responses' previous_response_id): names the reuse path
    replay: bool = False


@attrs.define
class GenerateRequest:
    """One request as every protocol hands it to the pipeline."""

    #: one prompt, or several (each gets ``n`` choices, indexed prompt-major)
    prompts: Sequence[Prompt]
    params: SamplingParams
    n: int = 1
    #: the LoRA adapter to run with (None: the base model)
    lora: Optional[str] = None
    #: what the tool calls must be, and what a plain answer must match
    tools: ToolRequest = ToolRequest()
    answer: Optional[GuideSpec] = None
    thinking: ThinkingRequest = ThinkingRequest()
    cache: CachePolicy = CachePolicy()
    #: ``params.max_tokens`` is a ceiling, shortened to the room a prompt leaves in the context
    #: and the KV pool (the batch format's max_generate_length; 0 stays 0: prompt only) rather
    #: than a demand the prompt must leave room for
    fit_max_tokens: bool = False
    #: False: decode without speculation even when the server has a speculative backend
    speculate: bool = True
    #: how a draft model proposes (auto, greedy, probabilistic: the batch format's
    #: spec_proposal_sampling)
    proposal: str = "auto"
    #: the engine requests' id prefix (default: the HTTP request's id)
    request_id: Optional[str] = None
    #: wire names for errors: the prompt's field, and the output limit's
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
