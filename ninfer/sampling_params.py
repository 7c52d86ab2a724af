"""Per-request generation settings, in the shape vLLM users know.

The sampling fields' defaults and the values they accept come from
:mod:`ninfer.sampling_schema`; ``validate`` checks them there.
"""

from __future__ import annotations

from typing import Optional

import attrs

from ninfer.errors import InvalidRequestError
from ninfer.guided.spec import GuideSpec
from ninfer.sampling_schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PROMPT_LOGPROBS, SAMPLING, check_params

__all__ = ["SamplingParams", "MAX_LOGPROBS", "MAX_PROMPT_LOGPROBS", "MAX_LOGIT_BIAS"]


def _schema(name: str):
    return SAMPLING[name].attribute()


@attrs.define
class SamplingParams:
    """What to generate and how.

    Sampler fields left as ``None`` are filled from the model family's presets for the
    request's thinking mode, then from process flags (see :mod:`ninfer.engine.defaults`).
    ``temperature == 0`` means greedy. Each field's meaning and range:
    :data:`ninfer.sampling_schema.FIELDS`.
    """

    n: int = _schema("n")
    temperature: Optional[float] = _schema("temperature")
    top_p: Optional[float] = _schema("top_p")
    top_k: Optional[int] = _schema("top_k")
    min_p: Optional[float] = _schema("min_p")
    presence_penalty: Optional[float] = _schema("presence_penalty")
    frequency_penalty: Optional[float] = _schema("frequency_penalty")
    repetition_penalty: Optional[float] = _schema("repetition_penalty")
    seed: Optional[int] = _schema("seed")
    max_tokens: Optional[int] = _schema("max_tokens")
    min_tokens: int = _schema("min_tokens")
    stop: list[str] = _schema("stop")
    stop_token_ids: list[int] = _schema("stop_token_ids")
    ignore_eos: bool = _schema("ignore_eos")
    #: top-N log probabilities per generated token (None = off, 0 = sampled token only)
    logprobs: Optional[int] = _schema("logprobs")
    #: log probabilities of the prompt's tokens plus top-N alternatives each (None = off);
    #: taken from the raw model logits, and computed afresh (no prefix-cache reuse)
    prompt_logprobs: Optional[int] = _schema("prompt_logprobs")
    logit_bias: dict[int, float] = _schema("logit_bias")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: constrain the output (see :mod:`ninfer.guided.spec`); with thinking on it applies
    #: from the end of the reasoning channel
    guided: Optional[GuideSpec] = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`~ninfer.errors.InvalidRequestError` naming the first bad field."""
        check_params(self, vocab_size)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:  # vLLM refuses it too
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                      f"({self.max_tokens})", param="min_tokens")
