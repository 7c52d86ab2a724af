"""Layering of sampler settings: family preset < process flags < request, then --greedy."""

from __future__ import annotations

import attrs
import pytest

from ninfer.engine.defaults import PROCESS_TOP_K_CAP, ProcessSamplingOverrides, ResolvedSampling, resolve_sampling
from ninfer.model.family import SamplingDefaults, SamplingPresets
from ninfer.sampling_params import SamplingParams

PRESETS = SamplingPresets(
    thinking=SamplingDefaults(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0),
    non_thinking=SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5),
)
NO_FLAGS = ProcessSamplingOverrides()


def _sampler_values(r: ResolvedSampling) -> tuple:
    return (r.temperature, r.top_p, r.top_k, r.min_p, r.presence_penalty, r.frequency_penalty, r.repetition_penalty)


def test_without_presets_values_are_neutral() -> None:
    r = resolve_sampling(SamplingParams(), None, True, NO_FLAGS)
    assert _sampler_values(r) == (1.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0)
    assert not r.greedy
    assert r.logit_bias == {} and r.logprobs is None


@pytest.mark.parametrize("thinking, expected", [(True, PRESETS.thinking), (False, PRESETS.non_thinking)])
def test_preset_follows_thinking_mode(thinking: bool, expected: SamplingDefaults) -> None:
    r = resolve_sampling(SamplingParams(), PRESETS, thinking, NO_FLAGS)
    assert _sampler_values(r) == attrs.astuple(expected)


def test_process_flags_override_presets_and_requests_override_flags() -> None:
    flags = ProcessSamplingOverrides(temperature=0.3, top_p=0.5, min_p=0.1, frequency_penalty=0.25)
    r = resolve_sampling(SamplingParams(), PRESETS, False, flags)
    assert (r.temperature, r.top_p, r.min_p, r.frequency_penalty) == (0.3, 0.5, 0.1, 0.25)
    assert r.presence_penalty == 1.5 and r.top_k == 20  # untouched preset values survive

    req = SamplingParams(temperature=0.9, top_p=0.6, top_k=7, repetition_penalty=1.1, presence_penalty=-0.5)
    r = resolve_sampling(req, PRESETS, False, flags)
    assert (r.temperature, r.top_p, r.top_k, r.repetition_penalty, r.presence_penalty) == (0.9, 0.6, 7, 1.1, -0.5)
    assert (r.min_p, r.frequency_penalty) == (0.1, 0.25)  # request left them unset


def test_greedy_flag_wins_over_request_temperature() -> None:
    flags = ProcessSamplingOverrides(temperature=0.8, greedy=True)
    r = resolve_sampling(SamplingParams(temperature=1.3), PRESETS, True, flags)
    assert r.temperature == 0.0 and r.greedy
    assert not resolve_sampling(SamplingParams(temperature=1.3), PRESETS, True, attrs.evolve(flags, greedy=False)).greedy


def test_request_temperature_zero_is_greedy() -> None:
    assert resolve_sampling(SamplingParams(temperature=0.0), PRESETS, True, NO_FLAGS).greedy


def test_process_top_k_zero_selects_the_cap_but_request_zero_disables() -> None:
    flags = ProcessSamplingOverrides(top_k=0)
    assert resolve_sampling(SamplingParams(), None, True, flags).top_k == PROCESS_TOP_K_CAP == 20
    assert resolve_sampling(SamplingParams(top_k=0), None, True, flags).top_k == 0
    assert resolve_sampling(SamplingParams(), None, True, ProcessSamplingOverrides(top_k=5)).top_k == 5


def test_samples_of_one_request_offset_the_seed_they_would_get() -> None:
    """One rule for every front door: sample i of n adds i to the request's seed, or to the
    process seed when the request gives none (so n samples differ under --seed too)."""
    flags = ProcessSamplingOverrides(seed=9)
    assert resolve_sampling(SamplingParams(seed=-4), None, True, flags, sample_index=2).seed == -2
    assert [resolve_sampling(SamplingParams(), None, True, flags, sample_index=i).seed for i in range(3)] == [9, 10, 11]
    fresh = {resolve_sampling(SamplingParams(), None, True, NO_FLAGS, sample_index=1).seed for _ in range(10)}
    assert len(fresh) == 10


def test_seed_precedence_and_fresh_random_seed() -> None:
    assert resolve_sampling(SamplingParams(seed=-4), None, True, ProcessSamplingOverrides(seed=9)).seed == -4
    assert resolve_sampling(SamplingParams(), None, True, ProcessSamplingOverrides(seed=9)).seed == 9
    seeds = {resolve_sampling(SamplingParams(), None, True, NO_FLAGS).seed for _ in range(20)}
    assert len(seeds) == 20
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)


def test_request_only_fields_are_carried_over() -> None:
    params = SamplingParams(logit_bias={3: 5.0}, logprobs=4)
    r = resolve_sampling(params, PRESETS, True, NO_FLAGS)
    assert r.logit_bias == {3: 5.0} and r.logprobs == 4
    params.logit_bias[3] = -1.0
    assert r.logit_bias == {3: 5.0}  # a copy: later edits to the request do not leak in


def test_penalty_flag() -> None:
    base = resolve_sampling(SamplingParams(), None, True, NO_FLAGS)
    assert not base.uses_penalties
    assert attrs.evolve(base, repetition_penalty=1.2).uses_penalties
    assert attrs.evolve(base, presence_penalty=0.5).uses_penalties
