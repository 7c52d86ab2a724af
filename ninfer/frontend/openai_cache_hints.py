"""OpenAI prompt-cache hints, read the same way by Chat Completions and Responses.

``prompt_cache_options.mode`` chooses whether the end of the conversation is an implicit
shared-prefix candidate; a ``prompt_cache_breakpoint`` on a content part marks an
explicit one. Each protocol finds the turn counts its marks end at (its messages or Items
lower to turns differently); :func:`latest_writes` then keeps what one request may write.
The TTL and retention values are only checked: residency follows the engine's own cache.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ninfer.errors import InvalidRequestError

#: shared-prefix writes one request may carry
MAX_CACHE_WRITES = 4
RETENTIONS = ("in_memory", "in-memory", "24h")
MODES = ("implicit", "explicit")
TTLS = ("30m", "12h")


def check_cache_hints(retention: Optional[str], options: Optional[Mapping[str, Any]]) -> None:
    """The request-level hints: ``prompt_cache_retention`` and ``prompt_cache_options``."""
    if retention is not None and retention not in RETENTIONS:
        raise InvalidRequestError("prompt_cache_retention must be in_memory or 24h", param="prompt_cache_retention")
    options = options or {}
    if options.get("mode") not in (None, *MODES):
        raise InvalidRequestError("prompt_cache_options.mode must be implicit or explicit",
                                  param="prompt_cache_options.mode")
    if options.get("ttl") not in (None, *TTLS):
        raise InvalidRequestError("prompt_cache_options.ttl must be 30m or 12h", param="prompt_cache_options.ttl")


def check_breakpoint(mark: Any, where: str) -> None:
    """A content part's ``prompt_cache_breakpoint`` (``mark``), if any, is ``{"mode": "explicit"}``."""
    if mark is not None and (not isinstance(mark, Mapping) or mark.get("mode") != "explicit"):
        raise InvalidRequestError('prompt_cache_breakpoint must be {"mode": "explicit"}',
                                  param=f"{where}.prompt_cache_breakpoint")


def has_breakpoint(content: Any) -> bool:
    """Whether a message's (or Item's) content parts carry a breakpoint."""
    return isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("prompt_cache_breakpoint") for p in content)


def implicit_breakpoint(options: Optional[Mapping[str, Any]], turns: int) -> Optional[int]:
    """The implicit candidate (after all ``turns``) unless ``mode`` asks for explicit marks only."""
    explicit_only = isinstance(options, Mapping) and options.get("mode") == "explicit"
    return None if explicit_only else turns


def latest_writes(counts: Sequence[int], implicit: Optional[int]) -> tuple[int, ...]:
    """The latest explicit turn counts (ascending ``counts``) that fit beside the implicit
    candidate, which takes a slot unless it coincides with one of them."""
    counts = sorted(set(counts))
    room = MAX_CACHE_WRITES - (implicit is not None and implicit not in counts)
    return tuple(counts[-room:]) if room > 0 else ()
