"""How one wire format spells the sampling fields: an alias map over :mod:`ninfer.sampling_schema`.

A protocol, the batch input format or any other reader lists the fields it takes as
:class:`WireField` entries: its own name for a field (Responses' ``max_output_tokens``,
Anthropic's ``stop_sequences``), a narrower range its contract promises, a cap on list
entries, what leaving the field out means, or the single value it accepts for a field
it cannot honour (Chat Completions takes ``repetition_penalty`` only as 1). Types,
the engine's ranges and the wording of errors stay in the schema, so each reader checks
a field the same way, and every error names the field as that reader spells it.

The map also writes the reader's msgspec request fields (:meth:`SamplingWire.struct`),
so a protocol's request type, its checks and its translation cannot list different fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import attrs
import msgspec

from ninfer.errors import UnsupportedFeatureError
from ninfer.sampling_schema import (
    BOOL,
    FLOAT,
    INT,
    SAMPLING,
    STRINGS,
    TOKEN_BIAS,
    TOKEN_IDS,
    Limits,
    Problem,
    SamplingField,
    invalid,
)


class _Omitted:
    def __repr__(self) -> str:
        return "OMITTED"


#: "not given": as ``absent``, keep ``SamplingParams``' own default; as ``only``, the field is honoured
OMITTED: Any = _Omitted()
#: reports a problem of the field spelled ``param``; ``unsupported``: the reader cannot honour the value
Report = Callable[[str, Problem, bool], None]


def raise_problem(param: str, problem: Problem, unsupported: bool = False) -> None:
    """The protocols' report: a 400 naming the field (``unsupported_parameter`` when it cannot be honoured)."""
    if unsupported:
        raise UnsupportedFeatureError(f"{param}: {problem.reason}", param=param)
    raise invalid(param, problem)


_WIRE_TYPES = {FLOAT: Optional[float], INT: Optional[int], STRINGS: Union[str, list[str], None],
               TOKEN_IDS: Optional[list[int]], TOKEN_BIAS: Optional[dict[str, float]], BOOL: Optional[bool]}


@attrs.frozen
class WireField:
    """One field as a reader spells it; everything not given follows the schema."""

    wire: str
    #: the schema field it sets (default: the same name)
    field: str = attrs.field(default=attrs.Factory(lambda self: self.wire, takes_self=True))
    #: narrower than the engine's range (it can only narrow)
    limits: Optional[Limits] = None
    #: the most strings / bias entries
    max_items: Optional[int] = None
    #: what leaving it out means; OMITTED leaves ``SamplingParams``' default
    absent: Any = OMITTED
    #: the one value accepted for a field this reader cannot honour (it never reaches the engine),
    #: and ``why`` others are refused
    only: Any = OMITTED
    why: str = ""
    #: the msgspec type when it differs from the kind's usual one
    wire_type: Any = None

    def __attrs_post_init__(self) -> None:
        if self.field not in SAMPLING:
            raise KeyError(f"{self.wire}: no sampling field {self.field!r} (see ninfer.sampling_schema)")

    @property
    def spec(self) -> SamplingField:
        return SAMPLING[self.field]

    @property
    def honoured(self) -> bool:
        return self.only is OMITTED

    def problem(self, value: Any, vocab_size: Optional[int] = None) -> Optional[Problem]:
        if not self.honoured:
            return None if value is None or value == self.only else Problem("", self.why)
        return self.spec.problem(value, self.limits, vocab_size, self.max_items)

    def description(self) -> str:
        spec = self.spec
        if not self.honoured:
            return f"{spec.doc} ({self.why})"
        if spec.kind in (FLOAT, INT):
            return f"{spec.doc}; {spec.limits.narrowed(self.limits).describe(spec.kind == INT)}"
        return spec.doc + (f"; at most {self.max_items}" if self.max_items is not None else "")

    def annotation(self) -> Any:
        return self.wire_type or _WIRE_TYPES[self.spec.kind]


class SamplingWire:
    """The sampling fields of one reader, in the order they are checked."""

    def __init__(self, *fields: WireField):
        names = [f.wire for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"a wire name is listed twice: {names}")
        self.fields = fields

    def __iter__(self) -> Iterator[WireField]:
        return iter(self.fields)

    def __getitem__(self, wire: str) -> WireField:
        return next(f for f in self.fields if f.wire == wire)

    def evolve(self, *changes: WireField, drop: Iterable[str] = ()) -> SamplingWire:
        """This map with ``changes`` replacing the fields of the same wire name (or joining), ``drop`` left out."""
        new, dropped = {c.wire: c for c in changes}, set(drop)
        kept = [new.pop(f.wire, f) for f in self.fields if f.wire not in dropped]
        return SamplingWire(*kept, *new.values())

    def _checked(self, source: Any, vocab_size: Optional[int], report: Report) -> Iterator[tuple[WireField, Any]]:
        """Each field with its converted value (OMITTED when absent, refused or not honoured)."""
        for f in self.fields:
            value = source.get(f.wire) if isinstance(source, Mapping) else getattr(source, f.wire)
            problem = f.problem(value, vocab_size)
            if problem is not None:
                report(f.wire, problem, not f.honoured)
            ok = value is not None and problem is None and f.honoured
            yield f, f.spec.convert(value) if ok else OMITTED

    def read(self, source: Any, *, vocab_size: Optional[int] = None, report: Report = raise_problem) -> dict[str, Any]:
        """Checked values by wire name; a field absent, refused or not honoured reads as its ``absent`` (or None).

        ``source`` is a decoded request (attributes) or a JSON object (a mapping).
        """
        return {f.wire: (None if f.absent is OMITTED else f.absent) if value is OMITTED else value
                for f, value in self._checked(source, vocab_size, report)}

    def check(self, source: Any, *, vocab_size: Optional[int] = None, report: Report = raise_problem) -> None:
        """Report each field's problem, if any (the default report raises at the first)."""
        for _ in self._checked(source, vocab_size, report):
            pass

    def params(self, source: Any, *, vocab_size: Optional[int] = None,
               report: Report = raise_problem) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments; of two spellings of one field, the first given wins."""
        out: dict[str, Any] = {}
        for f, value in self._checked(source, vocab_size, report):
            if value is not OMITTED and out.get(f.field) is None:
                out[f.field] = value
            elif value is OMITTED and f.absent is not OMITTED and f.field not in out:
                out[f.field] = f.absent
        return out

    def struct(self, name: str, *, base: Optional[type] = None, **options: Any) -> type:
        """A msgspec Struct with one optional member per wire field (described from the schema).

        A protocol's request type derives from it; ``options`` go to ``msgspec.defstruct``.
        """
        members = [(f.wire, Annotated[f.annotation(), msgspec.Meta(description=f.description())], None)
                   for f in self.fields]
        return msgspec.defstruct(name, members, bases=(base,) if base is not None else None, **options)
