"""Value parsers for profile fields.

Each parser takes a raw YAML/CLI value and returns it unchanged when it is allowed (a
:class:`Choice` returns its canonical spelling), or raises ``ValueError`` saying what is
allowed. They are deliberately strict (no
``"4" -> 4``, no ``True -> 1``, no ``4.5 -> 4``) so that a typo in a profile fails
loudly instead of changing meaning; the CLI converts flag text before it gets here.
``allowed()`` feeds both error messages and ``--help``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs


def _reject(allowed: str, value: Any) -> ValueError:
    return ValueError(f"expected {allowed}, got {value!r}")


@attrs.frozen
class Int:
    """An integer in ``lo..hi`` (either bound optional), or one of ``words``."""

    lo: int | None = None
    hi: int | None = None
    pow2: bool = False
    words: tuple[str, ...] = ()

    def allowed(self) -> str:
        kind = "a power of two" if self.pow2 else "an integer"
        if self.lo is not None and self.hi is not None:
            kind += f" in {self.lo}..{self.hi}"
        elif self.lo is not None:
            kind += f" >= {self.lo}"
        return ", ".join([kind, *self.words[:-1]]) + f" or {self.words[-1]}" if self.words else kind

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str) and value in self.words:
            return value
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok and (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
        ok = ok and (not self.pow2 or (value > 0 and value & (value - 1) == 0))
        if not ok:
            raise _reject(self.allowed(), value)
        return value


@attrs.frozen
class Float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); ints are accepted."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def allowed(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"a finite number {'>' if self.lo_open else '>='} {self.lo:g}"
        return "a finite number"

    def __call__(self, value: Any) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        ok = ok and (self.hi is None or value <= self.hi)
        if not ok:
            raise _reject(self.allowed(), value)
        return float(value)


@attrs.frozen
class Bool:
    def allowed(self) -> str:
        return "true or false"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise _reject(self.allowed(), value)
        return value


@attrs.frozen
class Str:
    """A non-empty string, optionally limited to ``choices``."""

    choices: tuple[str, ...] = ()

    def allowed(self) -> str:
        return "one of " + ", ".join(self.choices) if self.choices else "a non-empty string"

    def __call__(self, value: Any) -> Any:
        ok = isinstance(value, str) and value != "" and (not self.choices or value in self.choices)
        if not ok:
            raise _reject(self.allowed(), value)
        return value


@attrs.frozen
class Choice:
    """One of ``choices``, any letter case, or another spelling of one (``aliases``); returns the choice.

    For names users bring from other tools (``--dtype bfloat16``), which the rest of
    ninfer then only ever sees in one spelling.
    """

    choices: tuple[str, ...]
    #: (other spelling, choice) pairs; a tuple so the parser stays hashable
    aliases: tuple[tuple[str, str], ...] = ()

    def allowed(self) -> str:
        also = f" (or {', '.join(a for a, _ in self.aliases)})" if self.aliases else ""
        return "one of " + ", ".join(self.choices) + also

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            word = value.lower()
            if word in self.choices:
                return word
            for alias, choice in self.aliases:
                if word == alias:
                    return choice
        raise _reject(self.allowed(), value)


@attrs.frozen
class Names:
    """A non-empty list of non-empty names (plugin or protocol names)."""

    def allowed(self) -> str:
        return "a non-empty list of names"

    def __call__(self, value: Any) -> Any:
        ok = isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
        if not ok:
            raise _reject(self.allowed(), value)
        return list(value)


@attrs.frozen
class Optional:
    """``inner`` or null."""

    inner: Int | Float | Bool | Str | Choice | Names

    def allowed(self) -> str:
        return f"{self.inner.allowed()} or null"

    def __call__(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.inner(value)
        except ValueError:
            raise _reject(self.allowed(), value) from None


Parser = Int | Float | Bool | Str | Choice | Names | Optional
