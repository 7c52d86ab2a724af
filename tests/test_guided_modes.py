"""Guided decoding, mode by mode: 50 sampled generations each (temperature 1, one seed per
request, all in one ``generate`` call) on the tiny random model, and every output obeys
its guide. A random model is the harshest writer there is: it never follows a format on
its own, so each constraint holds only because of the masks.

Where a guide allows unbounded output (free JSON, free text around tool tags), a logit
bias towards closing tokens keeps generations short; the guide alone decides validity.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ninfer.guided.spec import GuideSpec
from ninfer.sampling_params import SamplingParams

N = 50


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=512, max_concurrency=8)


def sample(llm, spec: GuideSpec, max_tokens: int = 64, bias: dict[int, float] | None = None) -> list:
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=1000 + i, max_tokens=max_tokens, guided=spec,
                             logit_bias=bias or {}) for i in range(N)]
    outs = [o.outputs[0] for o in llm.generate(["Answer in the requested format."] * N, params, thinking=False)]
    assert len(outs) == N
    return outs


def tokens_with(tok, chars: bytes, without: bytes = b"") -> list[int]:
    return [i for i in range(tok.vocab_size)
            if any(c in tok.token_bytes(i) for c in chars) and not any(c in tok.token_bytes(i) for c in without)]


def finished_all(outs) -> None:
    reasons = [o.finish_reason for o in outs]
    assert reasons == ["stop"] * N, reasons


def test_json_object(llm):
    tok = llm.get_tokenizer()
    # closers up, openers down: objects nest rarely and strings end soon
    bias = {**{i: -5.0 for i in tokens_with(tok, b"{[")}, **{i: 5.0 for i in tokens_with(tok, b'"}]', b"{[")}}
    outs = sample(llm, GuideSpec("json_object"), max_tokens=96, bias=bias)
    finished_all(outs)
    for o in outs:
        assert isinstance(json.loads(o.text), dict), o.text
    assert len({o.text for o in outs}) > N // 2  # sampled, not one fixed answer


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"const": "cat"}, "weight": {"type": "integer", "minimum": 0, "maximum": 10}},
            "required": ["kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def test_json_schema(llm):
    outs = sample(llm, GuideSpec("json_schema", SCHEMA), max_tokens=80)
    finished_all(outs)
    values = [json.loads(o.text) for o in outs]
    for v in values:
        jsonschema.validate(v, SCHEMA)
    assert len({v["age"] for v in values}) > 5


def test_regex(llm):
    pattern = r"(?:0|[1-9][0-9]{0,2})\.[0-9]{2} (?:apples|pears|plums)(?:, [a-z]{1,5}){0,3}"
    outs = sample(llm, GuideSpec("regex", pattern))
    finished_all(outs)
    for o in outs:
        assert re.fullmatch(pattern, o.text), o.text
    assert len({o.text for o in outs}) > N // 2


def test_ebnf(llm):
    grammar = r'''
root     ::= greeting " " name punct
greeting ::= "hello" | "hi" | "hey there"
name     ::= [A-Z] [a-z] [a-z]? [a-z]?
punct    ::= "!" | "." | "?"
'''
    outs = sample(llm, GuideSpec("ebnf", grammar))
    finished_all(outs)
    for o in outs:
        assert re.fullmatch(r"(hello|hi|hey there) [A-Z][a-z]{1,3}[!.?]", o.text), o.text


def test_choice(llm):
    choices = ["yes", "no", "maybe later", "<think>"]
    outs = sample(llm, GuideSpec("choice", choices))
    finished_all(outs)
    assert {o.text for o in outs} <= set(choices)
    assert len({o.text for o in outs}) >= 3


TOOL_BEGIN = '<tool_call>\n{"name": "get_weather", "arguments": '
TOOL_END = "}\n</tool_call>"
TOOL_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_structural_tag(llm):
    tag = {"type": "structural_tag", "triggers": ["<tool_call>"],
           "structures": [{"begin": TOOL_BEGIN, "schema": TOOL_ARGS, "end": TOOL_END}]}
    tok = llm.get_tokenizer()
    # tool calls often, and an end-of-sequence now and then in the free text between them
    bias = {tok.token_to_id("<tool_call>"): 7.0, tok.eos_token_ids[0]: 4.0}
    outs = sample(llm, GuideSpec("structural_tag", tag), max_tokens=64, bias=bias)
    complete = 0
    for o in outs:
        segments = o.text.split("<tool_call>")[1:]
        for k, seg in enumerate(segments):
            seg = "<tool_call>" + seg
            if k == len(segments) - 1 and TOOL_END not in seg:
                # only the output's last call may be cut off, and only by the length limit
                assert o.finish_reason == "length" and seg.startswith(TOOL_BEGIN[: len(seg)]), o.text
                continue
            assert seg.startswith(TOOL_BEGIN), o.text
            args = json.JSONDecoder().raw_decode(seg[len(TOOL_BEGIN):])
            jsonschema.validate(args[0], TOOL_ARGS)
            assert seg[len(TOOL_BEGIN) + args[1]:].startswith(TOOL_END), o.text
            complete += 1
    assert complete >= N // 2  # the test saw many calls, not free text only
    assert any(o.finish_reason == "stop" for o in outs)
