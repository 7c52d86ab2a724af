"""The sampling fields, described once.

Everything that reads sampler settings (``SamplingParams``, the profile's process-wide
overrides, the batch input format, every HTTP protocol) used to list the fields itself,
each copy with its own ranges and messages, and the copies drifted apart (one protocol
silently ignored ``repetition_penalty``). Each field is now declared here once: its
kind, its ``SamplingParams`` default, the values the engine accepts, whether model
presets and a process flag may fill it in, and a line saying what it does. The others
derive from this table; a wire format only states how its spelling and contract differ
(:mod:`ninfer.sampling_wire`).

A check returns a :class:`Problem` (where inside the value, and why) instead of raising,
so each reader reports it in its own way: a 400 naming the field, or a line under the
batch file's JSON path. :func:`check_params` is the raising form ``SamplingParams`` uses.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, NamedTuple, Optional

import attrs

from ninfer.errors import InvalidRequestError

#: field kinds: a number, an integer, strings (one or a list), token ids, token id -> bias, a flag
FLOAT, INT, STRINGS, TOKEN_IDS, TOKEN_BIAS, BOOL = "float", "int", "strings", "token_ids", "token_bias", "bool"
#: the most top-N log probabilities a request may ask for per token
MAX_LOGPROBS = 50
#: the most top-N alternatives a request may ask for per prompt token
MAX_PROMPT_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
#: the largest process-wide top_k; the flag's 0 stands for this cap (a request's 0 turns the cap off)
PROCESS_TOP_K_CAP = 20


@attrs.frozen
class Limits:
    """The numbers a field admits: ``lo``..``hi`` (either end optional); ``lo_open`` excludes ``lo``."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False

    def admits(self, value: float) -> bool:
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return self.hi is None or value <= self.hi

    def narrowed(self, other: Optional[Limits]) -> Limits:
        """What both admit: a wire contract may promise less than the engine takes, never more."""
        if other is None:
            return self
        lo, lo_open = self.lo, self.lo_open
        if other.lo is not None and (lo is None or other.lo > lo or (other.lo == lo and other.lo_open)):
            lo, lo_open = other.lo, other.lo_open
        hi = self.hi if other.hi is None or (self.hi is not None and self.hi <= other.hi) else other.hi
        return Limits(lo, hi, lo_open)

    def describe(self, integer: bool) -> str:
        """``an integer in [0, 50]``, ``a number in [-2, 2]``, ``a number > 0.0 and <= 1.0``, ..."""
        kind = "an integer" if integer else "a number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None and not self.lo_open:
            return f"{kind} in [{lo}, {hi}]" if integer else f"{kind} in [{lo:g}, {hi:g}]"
        bounds = ([f"{'>' if self.lo_open else '>='} {lo}"] if lo is not None else []) + \
                 ([f"<= {hi}"] if hi is not None else [])
        return f"{kind} {' and '.join(bounds)}" if bounds else kind


class Problem(NamedTuple):
    """Why a value is refused: ``where`` inside it (``""``, ``"[2]"``, ``'["12"]'``), then ``reason``,
    worded to follow the field's name (``must be ...``)."""

    where: str
    reason: str


@attrs.frozen
class ProcessFlag:
    """A process-wide override of a request field: profile key ``sampling.NAME``, flag ``--NAME``."""

    help: str
    #: narrower than what a request may send (None: the same)
    limits: Optional[Limits] = None
    #: what applies while the flag is not given (for ``--help``)
    unset: str = "model preset"


@attrs.frozen
class SamplingField:
    """One field: its ``SamplingParams`` name, kind and what it does (shown in the API documents)."""

    name: str
    kind: str
    doc: str
    #: what the engine accepts (numbers; for token_bias, the bias values)
    limits: Limits = Limits()
    #: ``SamplingParams``' default (list and mapping kinds start empty)
    default: Any = None
    #: left None by a request, the model family's preset fills it in (then a process flag)
    preset: bool = False
    flag: Optional[ProcessFlag] = None

    def problem(self, value: Any, limits: Optional[Limits] = None, vocab_size: Optional[int] = None,
                max_items: Optional[int] = None) -> Optional[Problem]:
        """Why ``value`` cannot be used (None when it can; None is always fine: "not set")."""
        if value is None:
            return None
        bounds = self.limits.narrowed(limits)
        if self.kind in (FLOAT, INT):
            return _number(value, bounds, self.kind == INT)
        if self.kind == STRINGS:
            return _strings(value, max_items)
        if self.kind == TOKEN_IDS:  # ids past the vocabulary are harmless here: never sampled, never matched
            return _token_ids(value, max_items)
        if self.kind == BOOL:
            return None if isinstance(value, bool) else Problem("", "must be true or false")
        return _token_bias(value, bounds, vocab_size, max_items)

    def convert(self, value: Any) -> Any:
        """A checked wire value as ``SamplingParams`` holds it (JSON keys become ids; zero biases go)."""
        if self.kind == FLOAT:
            return float(value)
        if self.kind == STRINGS:
            return [value] if isinstance(value, str) else list(value)
        if self.kind == TOKEN_IDS:
            return list(value)
        if self.kind == TOKEN_BIAS:
            return {int(k): float(b) for k, b in value.items() if b != 0}
        return value

    def attribute(self) -> Any:
        """The ``attrs`` field declaring it on a class (``SamplingParams``)."""
        if self.kind in (STRINGS, TOKEN_IDS):
            return attrs.field(factory=list)
        if self.kind == TOKEN_BIAS:
            return attrs.field(factory=dict)
        return attrs.field(default=self.default)


def _number(value: Any, limits: Limits, integer: bool) -> Optional[Problem]:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and (integer or math.isfinite(value)) and limits.admits(value)
    return None if ok else Problem("", f"must be {limits.describe(integer)}")


def _too_many(items: Any, max_items: Optional[int]) -> Optional[Problem]:
    if max_items is not None and len(items) > max_items:
        return Problem("", f"has {len(items)} entries; at most {max_items} are allowed")
    return None


def _strings(value: Any, max_items: Optional[int]) -> Optional[Problem]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        return Problem("", "must be a non-empty string or an array of non-empty strings")
    return _too_many(items, max_items)


def _token_id(token: Any, vocab_size: Optional[int], key: bool = False) -> Optional[str]:
    """Why ``token`` (an int; as a mapping ``key`` also a JSON object key's digits) is not a token id."""
    if key and isinstance(token, str) and token.isascii() and token.isdigit():
        token = int(token)
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        return f"{'key ' if key else ''}must be a non-negative integer token id"
    if vocab_size is not None and token >= vocab_size:
        return f"is outside the vocabulary (token ids 0..{vocab_size - 1})"
    return None


def _token_ids(value: Any, max_items: Optional[int]) -> Optional[Problem]:
    if not isinstance(value, (list, tuple)):
        return Problem("", "must be an array of token ids")
    for i, token in enumerate(value):
        reason = _token_id(token, None)
        if reason is not None:
            return Problem(f"[{i}]", reason)
    return _too_many(value, max_items)


def _token_bias(value: Any, limits: Limits, vocab_size: Optional[int], max_items: Optional[int]) -> Optional[Problem]:
    if not isinstance(value, Mapping):
        return Problem("", "must be an object mapping token ids to bias values")
    too_many = _too_many(value, max_items)
    if too_many is not None:
        return too_many
    seen: dict[int, Any] = {}
    for token, bias in value.items():
        where = f"[{json.dumps(token)}]"
        reason = _token_id(token, vocab_size, key=True)
        if reason is None:
            refused = _number(bias, limits, integer=False)
            reason = refused.reason if refused is not None else None
        if reason is None:
            # "12" and "012" are one token: keeping either bias would silently drop the other
            first = seen.setdefault(int(token), token)
            if first != token:
                reason = f"names token {int(token)} again (also given as {json.dumps(first)})"
        if reason is not None:
            return Problem(where, reason)
    return None


_PRESET = {"preset": True}
FIELDS: tuple[SamplingField, ...] = (
    SamplingField("n", INT, "independent samples of the same prompt", Limits(lo=1), default=1),
    SamplingField("temperature", FLOAT, "divides the logits before sampling; 0 always picks the most likely token",
                  Limits(lo=0.0), flag=ProcessFlag("temperature override"), **_PRESET),
    SamplingField("top_p", FLOAT, "samples from the fewest tokens whose probabilities add up to top_p",
                  Limits(0.0, 1.0, lo_open=True), flag=ProcessFlag("top-p override"), **_PRESET),
    SamplingField("top_k", INT, "samples from the k most likely tokens; 0 turns the cap off", Limits(lo=0),
                  flag=ProcessFlag(f"top-k override (0 = the top-{PROCESS_TOP_K_CAP} cap)", Limits(0, PROCESS_TOP_K_CAP)), **_PRESET),
    SamplingField("min_p", FLOAT, "drops tokens less likely than min_p times the most likely one",
                  Limits(0.0, 1.0), flag=ProcessFlag("min-p override"), **_PRESET),
    SamplingField("presence_penalty", FLOAT, "subtracted from the logit of every token the output already holds",
                  Limits(-2.0, 2.0), flag=ProcessFlag("presence-penalty override"), **_PRESET),
    SamplingField("frequency_penalty", FLOAT, "subtracted from a token's logit once per time the output holds it",
                  Limits(-2.0, 2.0), flag=ProcessFlag("frequency-penalty override"), **_PRESET),
    SamplingField("repetition_penalty", FLOAT, "makes tokens of the prompt or output less likely by this factor; "
                  "1 is off", Limits(0.0, lo_open=True), **_PRESET),
    SamplingField("seed", INT, "makes sampling repeatable: a seeded request samples the same tokens whatever it "
                  "is batched with", Limits(-(2**63), 2**64 - 1),
                  flag=ProcessFlag("seed for requests that give none", unset="a fresh random seed per request")),
    SamplingField("max_tokens", INT, "the most tokens to generate (None: the server's default); 0 only reads "
                  "the prompt", Limits(lo=0), default=16),
    SamplingField("min_tokens", INT, "neither stop tokens nor stop strings end the output before it holds "
                  "this many tokens",
                  Limits(lo=0), default=0),
    SamplingField("stop", STRINGS, "strings that end the output where they appear (and are not returned)"),
    SamplingField("stop_token_ids", TOKEN_IDS, "token ids that end the output, besides end-of-sequence"),
    SamplingField("ignore_eos", BOOL, "keep generating through the model's end-of-sequence and end-of-turn "
                  "tokens (stop_token_ids and stop strings still end the output)", default=False),
    SamplingField("logprobs", INT, "log probabilities returned per generated token: the sampled one plus this "
                  "many top alternatives", Limits(0, MAX_LOGPROBS)),
    SamplingField("prompt_logprobs", INT, "log probabilities of the prompt's tokens, plus this many top "
                  "alternatives each", Limits(0, MAX_PROMPT_LOGPROBS)),
    SamplingField("logit_bias", TOKEN_BIAS, "token id -> a number in [-100, 100] added to that token's logit",
                  Limits(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)),
)
#: the fields by name
SAMPLING: dict[str, SamplingField] = {f.name: f for f in FIELDS}
#: fields the model family's presets fill in, and those a process-wide flag may override
PRESET_FIELDS = tuple(f.name for f in FIELDS if f.preset)
FLAG_FIELDS = tuple(f.name for f in FIELDS if f.flag is not None)


def invalid(param: str, problem: Problem) -> InvalidRequestError:
    """The 400 for ``problem``, naming ``param`` (the field as its reader spells it)."""
    return InvalidRequestError(f"{param}{problem.where} {problem.reason}", param=param)


def check_params(params: Any, vocab_size: Optional[int] = None) -> None:
    """Raise :class:`InvalidRequestError` for the first field of ``params`` the engine cannot take."""
    for field in FIELDS:
        problem = field.problem(getattr(params, field.name), vocab_size=vocab_size)
        if problem is not None:
            raise invalid(field.name, problem)
