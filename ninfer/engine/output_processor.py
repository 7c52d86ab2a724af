"""Per-request output handling: stop conditions, incremental text, logprobs.

Streaming and aggregate responses are both built from these events, so the
concatenated deltas always equal the final text.
"""

from __future__ import annotations

from typing import Optional

from ninfer.engine.defaults import stop_token_ids
from ninfer.engine.detokenizer import IncrementalDetokenizer
from ninfer.engine.stop import StopMatcher
from ninfer.outputs import PositionLogprobs, TokenLogprob


class RequestOutputState:
    """Turns committed token ids into text and decides when the request is done."""

    def __init__(self, tokenizer, params, eos_token_ids: list[int], max_tokens: int):
        self.tokenizer = tokenizer
        self.params = params
        self.max_tokens = max_tokens
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopMatcher(list(params.stop), include_stop_str=params.include_stop_str_in_output)
        self.stop_ids = set(stop_token_ids(params, eos_token_ids))
        self.num_output_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None

    def on_token(self, token_id: int) -> str:
        """Account one committed token; returns newly releasable text."""
        self.num_output_tokens += 1
        text = ""
        # As in vLLM, neither stop ids nor stop strings end the output until it holds more
        # than min_tokens tokens. The sampler bans stop ids until then, so a stop id here
        # early was committed unsampled (a forced token) and is ordinary output.
        armed = self.num_output_tokens > self.params.min_tokens
        if token_id in self.stop_ids and armed:
            # The stop token counts as output but its text is withheld.
            self.finish_reason, self.stop_reason = "stop", token_id
        else:
            emit, matched = self.stops.feed(self.detok.push([token_id]), armed)
            text = emit
            if matched is not None:
                self.finish_reason, self.stop_reason = "stop", matched
        if self.finish_reason is None and self.num_output_tokens >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not isinstance(self.stop_reason, str):
            # Held-back text is real output unless a stop string consumed it.
            text += self._flush()
        return text

    def finish(self, reason: str) -> str:
        """End early (abort, context capacity); returns held text still owed."""
        if self.finish_reason is None:
            self.finish_reason = reason
            return self._flush()
        return ""

    def _flush(self) -> str:
        emit, matched = self.stops.feed(self.detok.flush(), self.num_output_tokens > self.params.min_tokens)
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
            return emit
        return emit + self.stops.flush()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def logprobs(self, token_id: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> PositionLogprobs:
        top = [TokenLogprob(t, self._text(t), list(self.tokenizer.token_bytes(t)), lp) for t, lp in zip(top_ids, top_lps)]
        return PositionLogprobs(token_id=token_id, logprob=logprob, top=top)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
