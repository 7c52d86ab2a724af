"""The aggregate (non-streaming) chat completion, built from the same deltas a stream sends."""

from __future__ import annotations

from typing import Sequence

from ninfer.frontend.output_split import Delta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from ninfer.frontend.choice_output import ChoiceProgress
from ninfer_plugins.protocols.openai_chat.choice import finish_reason, timings, usage
from ninfer_plugins.protocols.openai_chat.schema import (
    AssistantOut,
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    FunctionOut,
    TokenLogprob,
    ToolCallOut,
)


class MessageBuilder:
    """Accumulates one choice's deltas and log probabilities."""

    def __init__(self, want_logprobs: bool):
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, ToolCallOut] = {}
        self.logprobs: list[TokenLogprob] | None = [] if want_logprobs else None

    def add(self, deltas: Sequence[Delta], logprobs: Sequence[TokenLogprob] = ()) -> None:
        for d in deltas:
            if isinstance(d, TextDelta):
                self.content.append(d.text)
            elif isinstance(d, ReasoningDelta):
                self.reasoning.append(d.text)
            elif isinstance(d, ToolCallStart):
                self.calls[d.index] = ToolCallOut(d.id, FunctionOut(d.name, ""))
            elif isinstance(d, ToolCallArgs):
                fn = self.calls[d.index].function
                fn.arguments += d.fragment
            elif isinstance(d, ToolCallEnd):
                self.calls[d.index].function.arguments = d.arguments
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)

    def message(self) -> AssistantOut:
        content = "".join(self.content)
        calls = [self.calls[i] for i in sorted(self.calls)]
        reasoning = "".join(self.reasoning)
        out = AssistantOut(content=content if content or not calls else None, reasoning_content=reasoning or None)
        if calls:
            out.tool_calls = calls
        return out

    def choice_logprobs(self) -> ChoiceLogprobs | None:
        return None if self.logprobs is None else ChoiceLogprobs(content=self.logprobs)


def completion(
    request_id: str, created: int, model: str, states: Sequence[ChoiceProgress], builders: Sequence[MessageBuilder]
) -> ChatCompletion:
    choices = [
        Choice(index=s.index, message=b.message(), finish_reason=finish_reason(s), logprobs=b.choice_logprobs())
        for s, b in zip(states, builders)
    ]
    return ChatCompletion(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage(states),
        timings=timings(states),
    )
