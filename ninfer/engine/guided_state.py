"""One guided request inside the engine: its matcher, and when the guide takes effect.

With thinking on, reasoning stays free text: the guide starts after the reasoning
closes. The chat format puts a separator (Qwen: a blank line) between the close marker
and the answer; the engine commits that separator itself right after the close marker
(unless the committed tokens already carry it, as a thinking-budget close does), so the
answer the guide shapes starts exactly where the chat template would render it.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import attrs

from ninfer.capabilities import ReasoningParser
from ninfer.errors import NinferError
from ninfer.guided.backend import GuideMatcher


class Phase(enum.Enum):
    MAY_OPEN = "may_open"  # thinking on and nothing open yet: the first token may open reasoning
    REASONING = "reasoning"  # free text until the close marker
    SEPARATOR = "separator"  # the close marker came; the separator tokens follow
    ACTIVE = "active"  # every token goes through the matcher


class GuideRejectedError(NinferError):
    """The guide refused a committed token: a bug or backend limit, fatal to that request only."""

    code = "guided_decoding_failed"


@attrs.frozen
class ReasoningMarkers:
    """The reasoning channel's tokens, as the engine sees them."""

    start_id: Optional[int]
    end_id: int
    separator: tuple[int, ...]

    @classmethod
    def from_parser(cls, parser: ReasoningParser, tokenizer) -> Optional["ReasoningMarkers"]:
        """None when the close marker is not a single token (the guide then applies from
        the first output token)."""
        end = tokenizer.encode(parser.end)
        if len(end) != 1:
            return None
        start = tokenizer.encode(parser.start)
        # the separator is what the budget close puts after the marker
        separator = parser.budget_close.rpartition(parser.end)[2] if parser.end in parser.budget_close else ""
        return cls(start[0] if len(start) == 1 else None, end[0], tuple(tokenizer.encode(separator)))

    def initial_phase(self, prompt_ids: Sequence[int], thinking: bool) -> Phase:
        tail = (self.end_id, *self.separator)
        if tuple(prompt_ids[-len(tail):]) == tail or prompt_ids[-1] == self.end_id:
            return Phase.ACTIVE  # the prompt itself closed reasoning (e.g. thinking turned off)
        last_end = _last_index(prompt_ids, self.end_id)
        if self.start_id is not None and _last_index(prompt_ids, self.start_id) > last_end:
            return Phase.REASONING  # the prompt leaves reasoning open
        return Phase.MAY_OPEN if thinking and self.start_id is not None else Phase.ACTIVE


def _last_index(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class GuidedState:
    """Feeds committed tokens to the matcher once the guide is in effect.

    ``end_ids`` are the end-of-sequence ids the backend's masks allow once the guide may
    end; none given, the masks alone decide when a guided row may stop.
    """

    def __init__(
        self, matcher: GuideMatcher, phase: Phase, markers: Optional[ReasoningMarkers], end_ids: Sequence[int] = ()
    ):
        self.matcher, self.phase, self.markers = matcher, phase, markers
        self.end_ids = tuple(end_ids)
        self._separator_pos = 0
        self.finished = False  # the guide is complete: the request ends with "stop"

    @property
    def masked(self) -> bool:
        """Whether the next sampled token is masked by the guide."""
        return self.phase in (Phase.ACTIVE, Phase.MAY_OPEN)

    @property
    def before_answer(self) -> bool:
        """Reasoning (or its separator) still runs: the guide has not started, so the
        request may not stop; the answer begins only through the close marker."""
        return self.phase in (Phase.REASONING, Phase.SEPARATOR)

    @property
    def extra_token(self) -> Optional[int]:
        """A token allowed beside the guide's (the reasoning opener, while it may come)."""
        return self.markers.start_id if self.phase is Phase.MAY_OPEN and self.markers else None

    @property
    def may_speculate(self) -> bool:
        """Whether a speculative round may verify drafts for this request now: in free
        reasoning and once the guide is active. The other phases last a single token (the
        first output token leaves MAY_OPEN; the engine commits the separator itself)."""
        return self.phase in (Phase.REASONING, Phase.ACTIVE)

    def verifiable(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` a speculative round may verify from the current state.

        The round stops *after* the first draft it cannot go past, never before it: the
        cut then depends only on drafts the round verifies, so exact acceptance holds
        for drafts sampled from a distribution that knows nothing of the guide. Cutting
        before a refused draft would give that position a plain draw, made exactly when
        the draft had landed on a refused token, and bias the output (a draw from the
        residual ``max(0, p - q)`` is what a rejection owes).

        In reasoning the drafts end with the close marker (after it the engine commits
        the separator unsampled, so :meth:`committable` drops the round's token past an
        accepted marker) or an end-of-sequence id (banned there, so never accepted).
        Once the guide is active they end with the first one the guide refuses (masked
        out at its verify row, so never accepted) or one that ends the request (the guide
        stops, or end-of-sequence: nothing after it is committed). The verify rows'
        masks are the guide's states after each kept draft
        (:meth:`GuidedMasks.verify_masks`). The matcher is left as it was."""
        if self.phase is Phase.REASONING:
            ends = (self.markers.end_id, *self.end_ids)
            return next((i + 1 for i, t in enumerate(drafts) if t in ends), len(drafts))
        if self.phase is not Phase.ACTIVE:
            return 0
        valid = self.matcher.validate_tokens(list(drafts))
        consumed = 0
        try:
            for i, token in enumerate(drafts[:valid]):
                if token in self.end_ids:
                    return i + 1
                self.matcher.consume_token(token)  # validated: cannot fail
                consumed += 1
                if self.matcher.is_stopped():
                    return i + 1
            return min(valid + 1, len(drafts))  # the refused draft, if any, stays to be rejected
        finally:
            self.matcher.rollback(consumed)

    def committable(self, tokens: Sequence[int]) -> int:
        """How many of a round's ``tokens`` (its accepted drafts, then the target's token)
        to commit: in reasoning, none past an accepted close marker. The separator the
        chat format puts after the marker is committed unsampled (:meth:`owed`), so the
        target's token drawn after the marker is dropped; plain decoding would not have
        sampled that position either."""
        if self.phase is Phase.REASONING and self.markers is not None:
            return next((i + 1 for i, t in enumerate(tokens) if t == self.markers.end_id), len(tokens))
        return len(tokens)

    def owed(self) -> list[int]:
        """Separator tokens to commit unsampled now (the close marker came without them)."""
        if self.phase is not Phase.SEPARATOR or self.markers is None:
            return []
        return list(self.markers.separator[self._separator_pos:])

    def on_token(self, token_id: int) -> None:
        """Account one committed token (sampled or forced), in order."""
        if self.phase is Phase.MAY_OPEN:
            if token_id == self.extra_token:
                self.phase = Phase.REASONING
                return
            self.phase = Phase.ACTIVE
        elif self.phase is Phase.REASONING:
            if token_id == self.markers.end_id:
                self.phase = Phase.SEPARATOR if self.markers.separator else Phase.ACTIVE
                self._separator_pos = 0
            return
        elif self.phase is Phase.SEPARATOR:
            if token_id == self.markers.separator[self._separator_pos]:
                self._separator_pos += 1
                if self._separator_pos == len(self.markers.separator):
                    self.phase = Phase.ACTIVE
                return
            self.phase = Phase.ACTIVE  # something else followed the marker: it belongs to the answer
        if not self.matcher.consume_token(token_id):
            detail = self.matcher.get_error().strip().splitlines()
            raise GuideRejectedError(
                f"guided decoding rejected token {token_id}" + (f": {detail[0]}" if detail else "")
            )
        self.finished = self.matcher.is_stopped()
