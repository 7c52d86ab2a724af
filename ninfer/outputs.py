"""Results returned by :class:`ninfer.LLM` (vLLM's names)."""

from __future__ import annotations

from typing import Optional

import attrs


@attrs.define
class TokenLogprob:
    token_id: int
    token: str
    bytes: list[int]
    logprob: float


@attrs.define
class PositionLogprobs:
    """One token's log probability (sampled, or given in the prompt) plus the top-N alternatives."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = attrs.field(factory=list)


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[object] = None  # matched stop string or stop token id
    logprobs: Optional[list[PositionLogprobs]] = None
    reasoning_tokens: int = 0


@attrs.define
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    #: with ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the
    #: first (nothing precedes it to predict it)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
