"""What the engine needs from a guided-decoding backend.

A :class:`ninfer.capabilities.GuidedDecodingBackend` plugin's ``factory(tokenizer,
vocab_size)`` returns a :class:`GuideCompiler`, built once per engine: it compiles a
request's :class:`~ninfer.guided.spec.GuideSpec` into a fresh :class:`GuideMatcher` and
fills the token bitmasks of many matchers at once.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ninfer.guided.spec import GuideSpec


class GuideMatcher(Protocol):
    """One request's position inside its guide."""

    def consume_token(self, token_id: int) -> bool:
        """Advance by one token; False when the guide forbids it (the matcher is then unusable)."""

    def is_stopped(self) -> bool:
        """The guide is complete and allows no further token (except end-of-sequence)."""

    def get_error(self) -> str:
        """Why the matcher failed ("" while it has not)."""

    # Speculative decoding looks ahead through a round's drafts and comes back:

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the guide would accept in turn (nothing is consumed)."""

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last ``num_tokens`` consumed tokens (end-of-sequence consumed once the
        guide had stopped is not one of them)."""


class GuideCompiler(Protocol):
    name: str

    def matcher(self, spec: GuideSpec) -> GuideMatcher:
        """A matcher at the start of ``spec``; raises
        :class:`ninfer.errors.InvalidRequestError` naming ``spec.param`` when the guide is
        malformed or unsupported."""

    def fill_bitmask(self, matchers: Sequence[GuideMatcher], bitmask: torch.Tensor, parallel: bool) -> None:
        """Write row ``i`` of ``bitmask`` (host int32 ``[>= len(matchers), ceil(V / 32)]``,
        contiguous) for ``matchers[i]``: bit ``t % 32`` of word ``t // 32`` set means
        token ``t`` may come next. ``parallel``: the host's cores are free for the rows
        (false while torch runs the model on those cores)."""
