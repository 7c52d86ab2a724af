"""Command-line flags generated from the profile schema.

Each option gets one flag whose argparse ``dest`` is its key path (``engine.max_context``),
so parsed flags are directly profile overrides. Flag text is only converted to the
option's Python type here; validation happens with the profile's, so a bad flag value
and a bad YAML value produce the same message naming the key.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Container, Mapping

import attrs

from ninfer.profile.checks import Bool, Float, Int, Names, Optional, Parser
from ninfer.profile.schema import Opt, flag_name, options

#: flag text that clears an optional key (e.g. ``--spec null`` over a profile that sets one)
NULL_WORD = "null"


def override_names() -> dict[str, tuple[str, bool]]:
    """Flat override name -> (key path, negate), e.g. ``no_prefix_reuse -> (engine.prefix_reuse, True)``.

    Flat names are the flags without ``--`` and with ``_`` for ``-``.
    """
    names: dict[str, tuple[str, bool]] = {"model": ("model", False)}
    for key, _, o in options():
        flag = flag_name(key, o)
        if flag is None:
            continue
        base = flag.replace("-", "_")
        names[base] = (key, False)
        if isinstance(o.parse, Bool):
            names[f"no_{base}"] = (key, True)
    return names


def _convert(parse: Parser) -> Callable[[str], Any]:
    """Flag text -> the option's type; text that does not convert is passed on for validation to reject."""
    inner = parse.inner if isinstance(parse, Optional) else parse

    def convert(text: str) -> Any:
        if isinstance(parse, Optional) and text == NULL_WORD:
            return None
        if isinstance(inner, Names):
            return [part.strip() for part in text.split(",") if part.strip()]
        number = int if isinstance(inner, Int) else float if isinstance(inner, Float) else None
        if number is not None:
            try:
                return number(text)
            except ValueError:
                return text
        return text

    return convert


class _Joined(argparse.Action):
    """Space-separated values, each maybe comma-separated, as one list; ``null`` alone clears it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values == [None]:
            setattr(namespace, self.dest, None)
            return  # a null among names stays text, which the NAME=PATH check refuses
        setattr(namespace, self.dest, [item for v in values for item in (v if v is not None else [NULL_WORD])])


def _default_text(field: attrs.Attribute, o: Opt) -> str:
    if o.default_text is not None:
        return o.default_text
    default = field.default
    if isinstance(default, bool):
        return "on" if default else "off"
    return "unset" if default is None else str(default)


def add_profile_flags(parser: argparse.ArgumentParser, omit: Container[str] = (),
                      help_texts: Mapping[str, str] = {}) -> None:
    """Add one flag per profile option, grouped by section; absent flags leave no attribute.

    ``omit``: key paths a command does not use (no flag); ``help_texts``: key path -> the
    command's own help for that flag, default included."""
    groups: dict[str, Any] = {}
    for key, field, o in options():
        flag = flag_name(key, o)
        if flag is None or key in omit:
            continue
        section = key.split(".", 1)[0] if "." in key else ""
        if section not in groups:
            title = f"{section} options (profile keys {section}.*)" if section else "model options (top-level keys)"
            groups[section] = parser.add_argument_group(title)
        help_text = help_texts.get(key, f"{o.help} (default: {_default_text(field, o)})").replace("%", "%%")
        common: dict[str, Any] = {"dest": key, "default": argparse.SUPPRESS, "help": help_text}
        if isinstance(o.parse, Bool):
            groups[section].add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, **common)
        elif o.spaced:
            groups[section].add_argument(f"--{flag}", type=_convert(o.parse), metavar=o.metavar, nargs="+",
                                         action=_Joined, **common)
        else:
            groups[section].add_argument(f"--{flag}", type=_convert(o.parse), metavar=o.metavar, **common)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The profile overrides the user gave on the command line, keyed by key path."""
    keys = {key for key, _, o in options() if flag_name(key, o) is not None}
    return {name: value for name, value in vars(args).items() if name in keys}

