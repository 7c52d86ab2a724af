"""What a loaded chat template lets a request control, read from the template's source.

Capabilities come from the template's syntax tree, never from the model's name: a
template that reads ``enable_thinking`` has a thinking switch, one that reads
``preserve_thinking`` can keep earlier turns' reasoning, and one that compares
``reasoning_effort`` against string literals exposes exactly those effort values. The
effort default is the literal the template falls back to when the variable is unset.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

import attrs
from jinja2 import nodes

from ninfer.tokenizer import compile_template

EFFORT_VARIABLE = "reasoning_effort"


@attrs.frozen
class TemplateCaps:
    """Prompt options the template reads; ``efforts`` keeps first-seen order."""

    enable_thinking: bool = False
    preserve_thinking: bool = False
    efforts: tuple[str, ...] = ()
    default_effort: str | None = None


@lru_cache(maxsize=16)
def detect_caps(source: str) -> TemplateCaps:
    """Inspect a chat template's source (cached: templates are fixed for a process)."""
    if not source:
        return TemplateCaps()
    tree = compile_template(source).environment.parse(source)
    read = {n.name for n in tree.find_all(nodes.Name) if n.ctx == "load"}
    effort_names = _effort_aliases(tree)
    efforts: dict[str, None] = {}
    for compare in tree.find_all(nodes.Compare):
        for value in _compared_literals(compare, effort_names):
            efforts.setdefault(value, None)
    default = _default_effort(tree) if EFFORT_VARIABLE in read else None
    if default is not None:
        efforts.setdefault(default, None)  # a template always accepts its own fallback
    return TemplateCaps(
        enable_thinking="enable_thinking" in read,
        preserve_thinking="preserve_thinking" in read,
        efforts=tuple(efforts),
        default_effort=default,
    )


def _reads(node: nodes.Node, names: set[str]) -> bool:
    return any(n.name in names for n in node.find_all(nodes.Name) if n.ctx == "load") or (
        isinstance(node, nodes.Name) and node.name in names
    )


def _effort_aliases(tree: nodes.Template) -> set[str]:
    """``reasoning_effort`` plus variables assigned from expressions that read it."""
    names = {EFFORT_VARIABLE}
    grew = True
    while grew:  # an alias of an alias still carries the effort
        grew = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, names):
                names.add(target.name)
                grew = True
    return names


def _string_literals(node: nodes.Node) -> Iterator[str]:
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (nodes.List, nodes.Tuple)):
        for item in node.items:
            yield from _string_literals(item)


def _compared_literals(compare: nodes.Compare, names: set[str]) -> Iterator[str]:
    """Literals on the far side of ``effort == 'x'``, ``'x' == effort``, ``effort in [...]``."""
    left = compare.expr
    for operand in compare.ops:
        right = operand.expr
        if operand.op in ("eq", "ne", "in", "notin"):
            if isinstance(left, nodes.Name) and left.name in names:
                yield from _string_literals(right)
            elif isinstance(right, nodes.Name) and right.name in names:
                yield from _string_literals(left)
        left = right


def _default_effort(tree: nodes.Template) -> str | None:
    """The fallback literal: ``reasoning_effort | default('x')``, ``set reasoning_effort =
    'x'`` or ``reasoning_effort if ... else 'x'``."""
    for node in tree.find_all((nodes.Filter, nodes.Assign, nodes.CondExpr)):
        if isinstance(node, nodes.Filter):
            if node.name == "default" and _is_effort(node.node) and node.args:
                value = _literal(node.args[0])
                if value is not None:
                    return value
        elif isinstance(node, nodes.Assign):
            if isinstance(node.target, nodes.Name) and node.target.name == EFFORT_VARIABLE:
                value = _literal(node.node)
                if value is not None:
                    return value
        elif _is_effort(node.expr1) and node.expr2 is not None:
            value = _literal(node.expr2)
            if value is not None:
                return value
    return None


def _is_effort(node: nodes.Node | None) -> bool:
    return isinstance(node, nodes.Name) and node.name == EFFORT_VARIABLE


def _literal(node: nodes.Node) -> str | None:
    return node.value if isinstance(node, nodes.Const) and isinstance(node.value, str) else None
