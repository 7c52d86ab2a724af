"""What a request asks its output to match: one guide, in a backend-neutral form.

Front doors (batch runner, HTTP protocols, tool-call parsers) translate their own fields
into a :class:`GuideSpec`; the selected guided-decoding backend plugin compiles it into a
token matcher. ``param`` names the request field the guide came from, so a schema,
pattern or grammar the backend refuses becomes a 400 that points at that field.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

GuideKind = Literal["json_object", "json_schema", "regex", "ebnf", "lark", "structural_tag", "choice"]

#: the kinds a user may name directly (``lark`` is produced by our own code, e.g. tool grammars)
USER_GUIDE_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "ebnf", "structural_tag", "choice")


@attrs.frozen
class GuideSpec:
    """One constraint.

    ``value`` by kind: ``json_object`` None; ``json_schema`` and ``structural_tag`` a
    dict; ``regex``, ``ebnf`` (GBNF) and ``lark`` a string; ``choice`` a list of strings.
    """

    kind: GuideKind
    value: Any = None
    #: dotted path of the request field this guide came from (for error messages)
    param: str = "guided_decoding"
