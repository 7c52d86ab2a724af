"""Resolve a request's sampler settings from family presets, process flags and the request.

Precedence, lowest first: the family preset for the request's thinking mode, then the
process-level flags, then the request's own fields; a process-wide ``greedy`` flag has the
last word and pins the temperature to zero.
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import attrs

from ninfer.model.family import SamplingDefaults, SamplingPresets
from ninfer.sampling_params import SamplingParams
from ninfer.sampling_schema import FLAG_FIELDS, INT, PRESET_FIELDS, PROCESS_TOP_K_CAP, SAMPLING

#: temperatures at or below this are treated as greedy (dividing by them is unsafe)
GREEDY_TEMPERATURE = 1e-5

_NEUTRAL = SamplingDefaults()
#: request fields the presets and then the process flags fill in (the seed has its own rule)
_PROCESS_FIELDS = tuple(name for name in FLAG_FIELDS if name in PRESET_FIELDS)


@attrs.frozen
class ProcessSamplingOverrides:
    """Sampler flags given when the process started; ``None`` means the flag was not set.

    One attribute per field :mod:`ninfer.sampling_schema` gives a process flag, plus ``greedy``.
    """

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    greedy: Optional[bool] = None


@attrs.frozen
class ResolvedSampling:
    """Every sampler setting of one request, with nothing left unset.

    ``top_k == 0`` disables the top-k filter. ``seed`` is the value the request (or the
    process) gave, possibly outside the signed 64-bit range; the sampler wraps it.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    logit_bias: dict[int, float] = attrs.field(factory=dict)
    logprobs: Optional[int] = None
    #: the sampler bans ``stop_token_ids`` until this many output tokens exist
    min_tokens: int = 0
    #: the token ids that end the request (see :func:`stop_token_ids`)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def resolve_sampling(
    params: SamplingParams,
    presets: SamplingPresets | None,
    thinking: bool,
    process: ProcessSamplingOverrides,
    eos_token_ids: Sequence[int] = (),
    sample_index: int = 0,
) -> ResolvedSampling:
    """Layer presets < process flags < request fields, then apply ``--greedy``.

    ``sample_index``: which of one request's ``n`` samples this is (see :func:`_pick_seed`)."""
    if presets is None:
        base = _NEUTRAL
    else:
        base = presets.thinking if thinking else presets.non_thinking
    values = {name: getattr(base, name) for name in PRESET_FIELDS}
    for name in _PROCESS_FIELDS:
        value = getattr(process, name)
        if value is not None:
            values[name] = value
    if process.top_k == 0:  # a process-level 0 asks for the cap, not for "no cap"
        values["top_k"] = PROCESS_TOP_K_CAP
    for name in PRESET_FIELDS:
        value = getattr(params, name)
        if value is not None:
            values[name] = value
    if process.greedy:
        values["temperature"] = 0.0
    return ResolvedSampling(
        **{name: _as_kind(name, value) for name, value in values.items()},
        seed=_pick_seed(params.seed, process.seed, sample_index),
        logit_bias=dict(params.logit_bias),
        logprobs=params.logprobs,
        min_tokens=params.min_tokens,
        stop_token_ids=stop_token_ids(params, eos_token_ids),
    )


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids that end a request: its own ``stop_token_ids``, plus end-of-sequence unless ``ignore_eos``."""
    ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    return tuple(dict.fromkeys(ids))


def _as_kind(name: str, value: float) -> float:
    return int(value) if SAMPLING[name].kind == INT else float(value)


def _pick_seed(request_seed: int | None, process_seed: int | None, sample_index: int = 0) -> int:
    """The request's seed, else the process's, else a fresh one; the ``n`` samples of one
    request add their index, so they differ from each other yet repeat run to run (the
    one rule for every front door; the sampler wraps seeds to 64 bits)."""
    seed = request_seed if request_seed is not None else process_seed
    if seed is None:
        return secrets.randbits(63)
    return seed + sample_index
