"""Per-request generation settings, in the shape vLLM users know."""

from __future__ import annotations

import math
from typing import Optional

import attrs

from ninfer.errors import InvalidRequestError
from ninfer.guided.spec import GuideSpec

#: the most top-N log probabilities a request may ask for per token
MAX_LOGPROBS = 50
#: the most top-N alternatives a request may ask for per prompt token
MAX_PROMPT_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@attrs.define
class SamplingParams:
    """What to generate and how.

    Sampler fields left as ``None`` are filled from the model family's presets for the
    request's thinking mode, then from process flags (see :mod:`ninfer.engine.defaults`).
    ``temperature == 0`` means greedy.
    """

    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = attrs.field(factory=list)
    stop_token_ids: list[int] = attrs.field(factory=list)
    ignore_eos: bool = False
    #: top-N log probabilities per generated token (None = off, 0 = sampled token only)
    logprobs: Optional[int] = None
    #: log probabilities of the prompt's tokens plus top-N alternatives each (None = off);
    #: taken from the raw model logits, and computed afresh (no prefix-cache reuse)
    prompt_logprobs: Optional[int] = None
    logit_bias: dict[int, float] = attrs.field(factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: constrain the output (see :mod:`ninfer.guided.spec`); with thinking on it applies
    #: from the end of the reasoning channel
    guided: Optional[GuideSpec] = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field."""
        _check_finite(self, "temperature", 0.0, None)
        _check_finite(self, "top_p", 0.0, 1.0, low_open=True)
        _check_finite(self, "min_p", 0.0, 1.0)
        _check_finite(self, "presence_penalty", -2.0, 2.0)
        _check_finite(self, "frequency_penalty", -2.0, 2.0)
        _check_finite(self, "repetition_penalty", 0.0, None, low_open=True)
        if self.n < 1:
            raise InvalidRequestError("n must be >= 1", param="n")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0 (0 disables it)", param="top_k")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError("max_tokens must be >= 0", param="max_tokens")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise InvalidRequestError("seed must fit in 64 bits", param="seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in 0..{MAX_LOGPROBS}", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be in 0..{MAX_PROMPT_LOGPROBS}", param="prompt_logprobs"
            )
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or (vocab_size is not None and not 0 <= tok < vocab_size):
                raise InvalidRequestError(f"logit_bias token id {tok} is outside the vocabulary", param="logit_bias")
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias for token {tok} must be a finite number in [-100, 100]", param="logit_bias"
                )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop strings must be non-empty strings", param="stop")


def _check_finite(p: SamplingParams, name: str, lo: float | None, hi: float | None, low_open: bool = False) -> None:
    v = getattr(p, name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequestError(f"{name} must be a finite number", param=name)
    if lo is not None and (v < lo or (low_open and v == lo)):
        raise InvalidRequestError(f"{name} must be {'>' if low_open else '>='} {lo}", param=name)
    if hi is not None and v > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}", param=name)
