"""The one sampling schema, and every place that derives from it.

The structural tests below fail when a reader of sampling fields (``SamplingParams``,
the engine's resolution, the profile, the batch format, a protocol) lists a field the
schema does not have, or drops one the schema says it must carry.
"""

from __future__ import annotations

import attrs
import msgspec
import pytest

from ninfer.batch.schema import GLOBAL_SAMPLING, REQUEST_SAMPLING, BatchInputError, parse_batch
from ninfer.engine.defaults import ProcessSamplingOverrides, ResolvedSampling
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.model.family import SamplingDefaults
from ninfer.profile import ProfileError, load_profile
from ninfer.profile.schema import Sampling
from ninfer.sampling_params import SamplingParams
from ninfer.sampling_schema import FIELDS, FLAG_FIELDS, INT, PRESET_FIELDS, SAMPLING, Limits
from ninfer.sampling_wire import WireField
from ninfer_plugins.protocols.anthropic_messages.schema import SAMPLING as ANTHROPIC, MessagesRequest
from ninfer_plugins.protocols.anthropic_messages.validate import sampling_params as anthropic_params
from ninfer_plugins.protocols.openai_chat.schema import SAMPLING as CHAT, ChatCompletionRequest
from ninfer_plugins.protocols.openai_chat.translate import sampling_params as chat_params
from ninfer_plugins.protocols.openai_chat.validate import validate_request
from ninfer_plugins.protocols.openai_chat.completions_routes import SAMPLING as COMPLETIONS, CompletionRequest, _params
from ninfer_plugins.protocols.openai_responses.schema import SAMPLING as RESPONSES, CreateRequest
from ninfer_plugins.protocols.openai_responses.validate import check_create

VOCAB = 512
#: every reader's map, with the request type built from it
PROTOCOLS = {"chat": (CHAT, ChatCompletionRequest), "completions": (COMPLETIONS, CompletionRequest),
             "responses": (RESPONSES, CreateRequest), "anthropic": (ANTHROPIC, MessagesRequest)}
WIRES = {**{name: wire for name, (wire, _) in PROTOCOLS.items()}, "batch": GLOBAL_SAMPLING,
         "batch request": REQUEST_SAMPLING}


def names(cls: type) -> list[str]:
    return [f.name for f in attrs.fields(cls)]


# -- the derived declarations ------------------------------------------------------------------


def test_sampling_params_declares_every_schema_field_with_its_default():
    declared, defaults = attrs.fields_dict(SamplingParams), SamplingParams()
    empty = {"token_bias": {}, "strings": [], "token_ids": []}
    for field in FIELDS:
        assert field.name in declared, field.name
        assert getattr(defaults, field.name) == empty.get(field.kind, field.default), field.name


def test_presets_flags_and_resolution_cover_the_same_fields():
    assert tuple(names(SamplingDefaults)) == PRESET_FIELDS
    assert set(PRESET_FIELDS) <= set(names(ResolvedSampling))
    assert names(ProcessSamplingOverrides) == [*FLAG_FIELDS, "greedy"]
    assert names(Sampling) == [*FLAG_FIELDS, "greedy"]  # the profile section, hence the --flags


def test_every_request_type_holds_its_wire_fields_and_they_exist_in_the_schema():
    for name, (wire, request) in PROTOCOLS.items():
        assert {f.wire for f in wire} <= set(request.__struct_fields__), name
        assert all(f.field in SAMPLING for f in wire), name


def test_openai_shaped_protocols_name_every_request_sampling_field_they_share():
    """Chat and legacy completions take the same sampler fields: none may go missing in one of them
    (completions used to drop repetition_penalty without a word)."""
    sampler = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "stop", "logit_bias", "n"}
    for wire in (CHAT, COMPLETIONS):
        assert sampler <= {f.field for f in wire}


def test_a_wire_map_can_only_name_schema_fields():
    with pytest.raises(KeyError, match="no sampling field 'temprature'"):
        WireField("temp", "temprature")


@pytest.mark.parametrize("reader", WIRES)
def test_no_reader_admits_a_number_the_engine_refuses(reader):
    for f in WIRES[reader]:
        spec = f.spec
        if spec.kind not in ("float", "int") or not f.honoured:
            continue
        limits = spec.limits.narrowed(f.limits)
        for value in (limits.lo, limits.hi):
            if value is not None and limits.admits(value):
                assert spec.limits.admits(value), (reader, f.wire, value)


# -- the rules -----------------------------------------------------------------------------------


def test_limits_narrow_and_describe():
    engine = Limits(0.0, 1.0, lo_open=True)
    assert engine.narrowed(Limits(0.0, 2.0)) == engine
    assert Limits(lo=0.0).narrowed(Limits(0.0, 2.0)) == Limits(0.0, 2.0)
    assert Limits(0, 50).narrowed(Limits(lo=1)) == Limits(1, 50)
    assert engine.describe(integer=False) == "a number > 0.0 and <= 1.0"
    assert Limits(-2.0, 2.0).describe(integer=False) == "a number in [-2, 2]"
    assert Limits(0, 20).describe(integer=True) == "an integer in [0, 20]"
    assert Limits(lo=1).describe(integer=True) == "an integer >= 1"


@pytest.mark.parametrize("fields,param", [
    ({"min_tokens": -1}, "min_tokens"),  # was never checked
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),  # was never checked
    ({"top_k": True}, "top_k"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_sampling_params_name_the_field_and_reason(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields).validate(VOCAB)
    assert e.value.param == param and e.value.message.startswith((param + " ", param + "["))
    assert "must be" in e.value.message or "outside the vocabulary" in e.value.message


def test_stop_token_ids_past_the_vocabulary_are_allowed():
    SamplingParams(stop_token_ids=[VOCAB + 3]).validate(VOCAB)  # never sampled, never matched: harmless


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def test_a_unicode_digit_logit_bias_key_is_a_400_not_a_crash():
    # "²".isdigit() is true but int("²") raises: the old check let it through to int()
    with pytest.raises(InvalidRequestError) as e:
        validate_request(chat(logit_bias={"²": 1.0}))
    assert e.value.param == "logit_bias" and "token id" in e.value.message


@pytest.mark.parametrize("fields,param,error", [
    ({"repetition_penalty": 1.2}, "repetition_penalty", UnsupportedFeatureError),
    ({"repetition_penalty": -1}, "repetition_penalty", UnsupportedFeatureError),
    ({"temperature": 2.5}, "temperature", InvalidRequestError),
    ({"top_p": 0}, "top_p", InvalidRequestError),  # the engine's bound, checked with the API's
    ({"top_k": 21}, "top_k", InvalidRequestError),
    ({"n": 17}, "n", InvalidRequestError),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", InvalidRequestError),
    ({"logit_bias": {"999999": 1}}, "logit_bias", InvalidRequestError),
])
def test_chat_sampling_errors(fields, param, error):
    with pytest.raises(error) as e:
        chat_params(chat(**fields), VOCAB)
    assert e.value.param == param


def test_chat_aliases_and_neutral_values():
    params = chat_params(chat(max_tokens=3, repetition_penalty=1, n=2), VOCAB)
    assert params.max_tokens == 3 and params.repetition_penalty is None and params.n == 1  # n: one per choice
    assert chat_params(chat(), VOCAB).max_tokens is None  # the server's default, not the Python API's 16


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


def test_completions_check_repetition_penalty_as_chat_does():
    with pytest.raises(UnsupportedFeatureError) as e:
        _params(completion(repetition_penalty=1.5), VOCAB)
    assert e.value.param == "repetition_penalty"
    assert _params(completion(repetition_penalty=1), VOCAB).repetition_penalty is None


def test_completions_spellings():
    params = _params(completion(logprobs=3, echo=True, stop="x"), VOCAB)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs, params.stop) == (16, 3, 3, ["x"])
    with pytest.raises(InvalidRequestError) as e:
        _params(completion(logprobs=6), VOCAB)
    assert e.value.param == "logprobs"


def test_responses_spellings():
    req = msgspec.convert({"input": "x", "max_output_tokens": -1}, CreateRequest)
    with pytest.raises(InvalidRequestError) as e:
        check_create(req)
    assert e.value.param == "max_output_tokens"  # named as the wire spells it
    with pytest.raises(UnsupportedFeatureError) as e:
        check_create(msgspec.convert({"input": "x", "top_logprobs": 3}, CreateRequest))
    assert e.value.param == "top_logprobs"
    values = RESPONSES.params(msgspec.convert({"input": "x", "top_logprobs": 0, "max_output_tokens": 5}, CreateRequest))
    assert values == {"max_tokens": 5}  # top_logprobs 0 asks for nothing and never reaches the engine


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop_sequences": ["ok", ""]}, "stop_sequences"),
])
def test_anthropic_spellings(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        anthropic_params(msgspec.convert({"messages": [], **fields}, MessagesRequest), VOCAB)
    assert e.value.param == param and e.value.message.startswith(param)


def test_anthropic_stop_sequences_become_stop():
    params = anthropic_params(msgspec.convert({"stop_sequences": ["##"], "top_k": 40}, MessagesRequest), VOCAB)
    assert (params.stop, params.top_k, params.max_tokens) == (["##"], 40, None)


def test_the_batch_format_reports_every_sampling_problem_under_its_path():
    with pytest.raises(BatchInputError) as info:
        parse_batch({"top_p": 1.5, "max_generate_length": -1, "requests": [
            {"messages": [{"role": "user", "content": "a"}], "sampling_seed": -1, "logit_bias": {"5": "x"}}]})
    assert sorted(e.split(":")[0] for e in info.value.errors) == [
        "max_generate_length", 'requests[0].logit_bias["5"]', "requests[0].sampling_seed", "top_p"]


def test_the_profile_takes_the_seed_range_requests_have():
    assert load_profile(model="m", overrides={"seed": 2**64 - 1}).sampling.seed == 2**64 - 1
    with pytest.raises(ProfileError) as info:
        load_profile(model="m", overrides={"seed": 2**64})
    assert info.value.errors[0].startswith("sampling.seed: ")


def test_int_fields_stay_ints():
    assert all(isinstance(SAMPLING[name].convert(3), int) for name in SAMPLING if SAMPLING[name].kind == INT)
