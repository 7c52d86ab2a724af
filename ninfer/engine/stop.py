"""Stop strings over streamed text, with holdback.

Text that might be the start of a stop string is held back until the next chunk decides
it, so a stop string never leaks into the output, even partially, and a match may span
any number of chunks. When one chunk completes several stop strings, the match starting
earliest in the stream wins, and of those starting at the same place the longest.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed decoded text chunks; get back the part that is safe to emit."""

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops: list[str] = list(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        #: the stop string that ended the stream, once one has
        self.matched: str | None = None
        self._held = ""
        self._max_held = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str, armed: bool = True) -> tuple[str, str | None]:
        """Return ``(text to emit, matched stop or None)``; after a match the stream is over.

        Unarmed (before ``min_tokens``) nothing matches, but the start of a stop string is
        still held back: a stop completed by the first armed chunk never leaks.
        """
        if self.matched is not None:
            raise RuntimeError("StopMatcher fed after a stop string matched")
        if not self.stops:
            return text, None
        buffer = self._held + text
        match = self._earliest_match(buffer) if armed else None
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return buffer[: start + len(stop) if self.include_stop_str else start], stop
        keep = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release held text when generation ends without a stop."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -len(best[1]))):
                best = (at, stop)
        return best

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that some stop string begins with."""
        for n in range(min(len(buffer), self._max_held), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0
