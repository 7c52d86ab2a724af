"""Where a rendered chat prompt's turns end, for the context cache's checkpoints.

The engine keeps checkpoints at two kinds of place (:mod:`ninfer.engine.context_cache`):
a prompt's *turn closure*, where the generation prologue begins (the next turn renders
everything before it again), and *marked boundaries* the client asked to share
(Anthropic ``cache_control``, OpenAI's prompt-cache candidates), given by the protocol
as turn counts: "after the first k turns" (:attr:`ChatPrompt.cache_breakpoints`).

Every template this server renders is ChatML (Qwen's): a message is ``<|im_start|>role
... <|im_end|>``, so both are found in the prompt's own tokens. The closure is the last
``<|im_start|>``; the boundary after k turns is right after the ``<|im_end|>`` that
closes the k-th rendered message, where a run of tool results renders as one message
and tools without a system message get a system message of their own. A boundary that
falls inside a rendered message (between two tool results) is not representable and is
left out. Hints only choose where checkpoints go; reuse itself always compares tokens,
so a misplaced hint can cost a hit but never change an output.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ninfer.engine.context_cache import CacheHints
from ninfer.frontend.chat_messages import template_role
from ninfer.frontend.pipeline_request import ChatPrompt

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def _ends(ids: Sequence[int], end_id: int) -> list[int]:
    return [i + 1 for i, t in enumerate(ids) if t == end_id]


def _message_count(prompt: ChatPrompt, turns: int) -> Optional[int]:
    """Rendered messages the first ``turns`` turns make (None: the boundary splits one)."""
    roles = [template_role(t.role) for t in prompt.turns]  # as rendered: developer is system
    if 0 < turns < len(roles) and roles[turns - 1] == "tool" and roles[turns] == "tool":
        return None  # between two tool results, which render as one message
    count = 1 if prompt.tools and (not roles or roles[0] != "system") else 0  # tools get a system message
    for i in range(turns):
        if not (roles[i] == "tool" and i > 0 and roles[i - 1] == "tool"):
            count += 1
    return count


def chat_cache_hints(prompt: Any, token_ids: Sequence[int], tokenizer: Any, replay: bool = False) -> CacheHints:
    """The hints of one rendered prompt (none for a raw text prompt or a non-ChatML vocabulary)."""
    if not isinstance(prompt, ChatPrompt):
        return CacheHints(replay=replay)
    start_id, end_id = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
    if start_id is None or end_id is None:
        return CacheHints(replay=replay)
    closure = None
    if prompt.add_generation_prompt or prompt.continue_final:
        starts = [i for i in range(len(token_ids) - 1, -1, -1) if token_ids[i] == start_id][:1]
        closure = starts[0] if starts and starts[0] > 0 else None
    ends = _ends(token_ids, end_id) if prompt.cache_breakpoints or prompt.implicit_breakpoint else []

    def boundaries(turn_counts) -> tuple[int, ...]:
        found = []
        for turns in sorted(set(turn_counts)):
            count = _message_count(prompt, min(turns, len(prompt.turns)))
            if count and count <= len(ends):
                found.append(ends[count - 1])
        return tuple(found)

    implicit = () if prompt.implicit_breakpoint is None else (prompt.implicit_breakpoint,)
    return CacheHints(turn_closure=closure, shared=boundaries(prompt.cache_breakpoints),
                      implicit_shared=boundaries(implicit), replay=replay)
