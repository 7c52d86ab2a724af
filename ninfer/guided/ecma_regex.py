r"""User regular expressions (ECMA-262, as in JSON Schema) rewritten in Rust ``regex`` syntax.

Clients write patterns the way JavaScript and JSON Schema read them; llguidance compiles
Rust ``regex`` syntax. The two agree on everyday patterns except the shorthand classes:
Rust reads ``\d``, ``\w`` and ``\s`` as Unicode classes (``\d`` admits Devanagari and
Arabic-Indic digits), ECMA as fixed sets, and Rust's ``.`` admits ``\r`` and the Unicode
line separators, ECMA's does not. :func:`ecma_to_rust` spells each of them out.

To know whether a shorthand sits inside a character class it parses classes by ECMA's
rules, and writes their contents so that Rust reads them the same way: inside a class
Rust gives ``[``, ``&&``, ``--`` and ``~~`` a meaning, ECMA takes them literally.
Everything outside classes other than the shorthands is copied unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

DIGIT = "0-9"
WORD = "0-9A-Za-z_"
#: ECMA's WhiteSpace and LineTerminator (space written as \x{20}: Rust's x flag drops a bare one)
SPACE = r"\t\n\x{B}\x{C}\r\x{20}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
_SETS = {"d": DIGIT, "w": WORD, "s": SPACE}
#: ECMA's ``.``: anything but a line terminator (Rust's ``.`` excludes only ``\n``)
DOT = r"[^\n\r\x{2028}\x{2029}]"
#: every code point (ECMA's ``[^]``; negated, ECMA's ``[]``, which matches nothing)
ANY = r"\x{0}-\x{10FFFF}"
#: characters with a meaning inside a Rust class that ECMA reads literally there
_CLASS_SYNTAX = set("[^&~")
_HEX = set("0123456789abcdefABCDEF")


class PatternError(ValueError):
    """The pattern is not a regular expression (or not one we can rewrite faithfully)."""


def ecma_to_rust(pattern: str) -> str:
    """``pattern`` (ECMA-262 syntax) in Rust ``regex`` syntax, its classes read as ECMA reads them."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            letter = _escaped(pattern, i)
            out.append(_shorthand(letter, in_class=False) if letter in "dDwWsS" else c + letter)
            i += 2
        elif c == "[":
            text, i = _char_class(pattern, i)
            out.append(text)
        elif c == ".":
            out.append(DOT)
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _escaped(pattern: str, i: int) -> str:
    if i + 1 >= len(pattern):
        raise PatternError("the pattern ends with a lone backslash")
    return pattern[i + 1]


def _shorthand(letter: str, in_class: bool) -> str:
    """A shorthand's set; inside a class a positive one joins the class without brackets."""
    members = _SETS[letter.lower()]
    if letter.isupper():
        return f"[^{members}]"  # nested inside a class: Rust takes the union
    return members if in_class else f"[{members}]"


class _Atom(NamedTuple):
    text: str  # Rust class syntax for it
    kind: str  # "char", "set" (a class, never a range end) or "dash" (an unescaped "-")


def _char_class(pattern: str, start: int) -> tuple[str, int]:
    """The Rust text of the class opening at ``start``, and the index after its ``]``."""
    i = start + 1
    negated = pattern.startswith("^", i)
    if negated:
        i += 1
    atoms: list[_Atom] = []
    while True:
        if i >= len(pattern):
            raise PatternError(f"the character class opened at offset {start} is never closed")
        if pattern[i] == "]":  # ECMA: the first "]" closes, even right after "[" or "[^"
            break
        atom, i = _class_atom(pattern, i)
        atoms.append(atom)
    if not atoms:
        return (f"[{ANY}]" if negated else f"[^{ANY}]"), i + 1
    return "[" + "^" * negated + _class_body(atoms) + "]", i + 1


def _class_atom(pattern: str, i: int) -> tuple[_Atom, int]:
    c = pattern[i]
    if c != "\\":
        if c == "-":
            return _Atom(r"\-", "dash"), i + 1
        return _Atom("\\" + c if c in _CLASS_SYNTAX else c, "char"), i + 1
    letter = _escaped(pattern, i)
    if letter in "dDwWsS":
        return _Atom(_shorthand(letter, in_class=True), "set"), i + 2
    if letter == "b":  # backspace inside an ECMA class; Rust has no such escape there
        return _Atom(r"\x{8}", "char"), i + 2
    if letter in "pP" and pattern.startswith("{", i + 2):  # a Unicode property: a set
        end = pattern.find("}", i + 2)
        if end < 0:
            raise PatternError(f"the property escape at offset {i} is never closed")
        return _Atom(pattern[i:end + 1], "set"), end + 1
    end = _escape_end(pattern, i + 2, letter)
    return _Atom(pattern[i:end], "char"), end


def _escape_end(pattern: str, i: int, letter: str) -> int:
    r"""Where an escape that names one character (``\x41``, ``\u{1F600}``, ``\cJ``) ends."""
    if letter in "xu" and pattern.startswith("{", i):
        close = pattern.find("}", i)
        return close + 1 if close >= 0 else len(pattern)
    if letter in "xu":
        limit = i + (2 if letter == "x" else 4)
        while i < min(limit, len(pattern)) and pattern[i] in _HEX:
            i += 1
        return i
    if letter == "c" and i < len(pattern) and pattern[i].isascii() and pattern[i].isalpha():
        return i + 1
    while letter.isdigit() and i < len(pattern) and pattern[i].isdigit():
        i += 1
    return i


def _class_body(atoms: list[_Atom]) -> str:
    r"""ECMA's reading of a class's atoms: ``x-y`` is a range unless either end is a set
    (then, by Annex B, the union of both ends and a literal dash, as in ``[\w-.]``)."""
    out = []
    k = 0
    while k < len(atoms):
        first = atoms[k]
        if k + 2 < len(atoms) and atoms[k + 1].kind == "dash":
            last = atoms[k + 2]
            if "set" in (first.kind, last.kind):
                out += [first.text, r"\-", last.text]
            else:
                out.append(f"{first.text}-{last.text}")
            k += 3
        else:
            out.append(first.text)
            k += 1
    return "".join(out)
