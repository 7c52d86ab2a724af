"""Prompt-lookup drafting (``--spec ngram``): propose what followed the last occurrence
of the sequence's trailing n-gram.

No draft model and no device work: the proposal is a search of the sequence's own
tokens (prompt and output) on the host, longest n-gram first. It pays off where the
output repeats its context, as code edits, quoting and extraction do; elsewhere it finds
nothing and the row decodes plainly. It also exercises the speculative round (verify,
acceptance, rollback) on every model family, since it needs no weights.
"""

from __future__ import annotations

from typing import Callable

from ninfer.capabilities import SpeculativeBackend
from ninfer.hookspecs import hookimpl

#: longest and shortest trailing n-gram searched for
MAX_NGRAM = 4
MIN_NGRAM = 2
#: how far back the search looks, in tokens (bounds its host cost on long contexts)
SEARCH_WINDOW = 8192


class NgramProposer:
    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM, window: int = SEARCH_WINDOW):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    needs_hidden = False

    def after_step(self, record) -> None:
        pass

    def propose(self, seq, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier match of the tail."""
        tokens = seq.token_ids[-self.window:]
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            tail = tokens[end - n:]
            first = tail[0]
            # latest start i < end - n whose n tokens equal the tail and that has a successor
            for i in range(end - n - 1, -1, -1):
                if tokens[i] == first and tokens[i:i + n] == tail:
                    return tokens[i + n:i + n + limit]
        return []


def _factory(ctx) -> NgramProposer:
    return NgramProposer()


NGRAM = SpeculativeBackend(
    name="ngram",
    description="prompt lookup: drafts what followed the last match of the trailing n-gram (no draft model)",
    draft_tokens=(1, 15),
    factory=_factory,
)


@hookimpl
def register_speculative_backends(register: Callable[[SpeculativeBackend], None]) -> None:
    register(NGRAM)
