"""Tool-call grammars (qwen3_xml, hermes_json): compiled by llguidance on the tiny tokenizer.

Hand-written outputs are fed to a matcher byte-exact (added tokens as the single tokens
the model emits) to show what each grammar accepts; random walks through the masks show
that whatever a grammar lets a model write, the format's tool parser reads back as a
call whose arguments follow the schema.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import numpy as np
import pytest

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.output_split import TextDelta, ToolCallEnd, ToolCallStart
from ninfer.frontend.tool_schema import ToolSpec
from ninfer.guided.spec import GuideSpec
from ninfer.tiny.tokenizer_files import IM_END, build_tokenizer
from ninfer_plugins.tool_parsers.hermes_json import HermesJsonToolParser
from ninfer_plugins.tool_parsers.hermes_json_grammar import hermes_grammar
from ninfer_plugins.tool_parsers.qwen3_xml import Qwen3XmlToolParser
from ninfer_plugins.tool_parsers.qwen3_xml_grammar import qwen3_xml_grammar

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = ToolSpec("get_weather", WEATHER_SCHEMA, strict=True, param="tools[0].function.parameters")
NOTE = ToolSpec("note", {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4}}},
                strict=True, param="tools[1].function.parameters")
LOOSE = ToolSpec("lookup", {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                            "required": ["q"]})
FREE = ToolSpec("free")
FORMATS = {
    "qwen3_xml": (qwen3_xml_grammar, Qwen3XmlToolParser),
    "hermes_json": (hermes_grammar, HermesJsonToolParser),
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    return tok, llguidance.LLTokenizer(tok.to_str(), eos_token=[tok.token_to_id(IM_END)])


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with the tool tags as their single added tokens."""
    tok, ll = tokenizer
    ids: list[int] = []
    for part in re.split(r"(</?tool_call>)", text):
        if part in ("<tool_call>", "</tool_call>"):
            ids.append(tok.token_to_id(part))
        elif part:
            ids += ll.tokenize_str(part)
    return ids


def matcher(tokenizer, spec: GuideSpec) -> llguidance.LLMatcher:
    assert spec.kind == "lark"
    m = llguidance.LLMatcher(tokenizer[1], spec.value, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tokenizer, spec: GuideSpec, text: str) -> bool:
    """The grammar lets the model write exactly ``text`` and then stop."""
    m = matcher(tokenizer, spec)
    ids = encode(tokenizer, text)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def parse(parser_cls, tools, text: str) -> tuple[str, list[tuple[str, dict]]]:
    parser = parser_cls(tools)
    deltas = parser.feed(text) + parser.finish()
    names = {d.index: d.name for d in deltas if isinstance(d, ToolCallStart)}
    calls = [(names[d.index], json.loads(d.arguments)) for d in deltas if isinstance(d, ToolCallEnd)]
    return "".join(d.text for d in deltas if isinstance(d, TextDelta)), calls


# -- what each grammar accepts --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_allows_only_valid_calls_of_listed_tools(tokenizer, fmt):
    build, _ = FORMATS[fmt]
    spec = build([WEATHER, LOOSE], "required")
    if fmt == "qwen3_xml":
        good = xml_call("get_weather", ("city", "Rome"), ("days", "3"))
        bad = [xml_call("get_weather", ("city", "Oslo"), ("days", "3")),  # not in the enum
               xml_call("get_weather", ("city", "Rome")),  # required days missing
               xml_call("get_weather", ("city", "Rome"), ("days", "9")),  # above the maximum
               xml_call("lookup", ("q", "a"), ("n", "x")),  # n must be an integer even when not strict
               xml_call("other")]
        loose = xml_call("lookup", ("n", "2"))  # non-strict: required q may be left out
    else:
        good = json_call("get_weather", {"city": "Rome", "days": 3})
        bad = [json_call("get_weather", {"city": "Oslo", "days": 3}),
               json_call("get_weather", {"city": "Rome"}),
               json_call("get_weather", {"city": "Rome", "days": 9}),
               json_call("lookup", {"q": "a", "n": "x"}),
               json_call("other", {})]
        loose = json_call("lookup", {"n": 2})
    assert accepts(tokenizer, spec, good) and accepts(tokenizer, spec, loose)
    assert accepts(tokenizer, spec, good + "\n" + loose)  # parallel calls, one newline apart
    for text in bad + ["plain text", "Sure. " + good, good + " done"]:
        assert not accepts(tokenizer, spec, text), text
    single = build([WEATHER], "required", parallel=False)
    assert accepts(tokenizer, single, good) and not accepts(tokenizer, single, good + "\n" + good)


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_allows_text_or_valid_calls(tokenizer, fmt):
    build, _ = FORMATS[fmt]
    spec = build([WEATHER], "auto")
    call = xml_call("get_weather", ("city", "Paris"), ("days", "1")) if fmt == "qwen3_xml" \
        else json_call("get_weather", {"city": "Paris", "days": 1})
    bad = xml_call("get_weather", ("city", "Oslo"), ("days", "1")) if fmt == "qwen3_xml" \
        else json_call("get_weather", {"city": "Oslo", "days": 1})
    assert accepts(tokenizer, spec, "It is sunny.") and accepts(tokenizer, spec, "")
    assert accepts(tokenizer, spec, "Let me check.\n" + call)
    assert not accepts(tokenizer, spec, "Let me check.\n" + bad)  # once a call opens, it is valid
    assert not accepts(tokenizer, spec, call + "\nThat was it.")  # nothing after the calls
    assert not accepts(tokenizer, spec, "spelled <tool_call> out")  # nor a tag in the text
    single = build([WEATHER], "auto", parallel=False)
    assert not accepts(tokenizer, single, call + "\n" + call)


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_with_an_answer_schema(tokenizer, fmt):
    build, _ = FORMATS[fmt]
    answer = GuideSpec("json_schema", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                       "required": ["ok"]}, "response_format.json_schema.schema")
    spec = build([WEATHER], "auto", answer=answer)
    call = xml_call("get_weather", ("city", "Paris"), ("days", "1")) if fmt == "qwen3_xml" \
        else json_call("get_weather", {"city": "Paris", "days": 1})
    assert accepts(tokenizer, spec, '{"ok": true}') and accepts(tokenizer, spec, call)
    assert not accepts(tokenizer, spec, "free text") and not accepts(tokenizer, spec, '{"no": 1}')
    with pytest.raises(UnsupportedFeatureError) as info:
        build([WEATHER], "auto", answer=GuideSpec("regex", "a+", "guided_regex"))
    assert info.value.param == "guided_regex"


def test_qwen3_xml_values_are_text_or_json_by_type(tokenizer):
    spec = qwen3_xml_grammar([NOTE, FREE], "required")
    assert accepts(tokenizer, spec, xml_call("note", ("text", "a\nb")))
    assert accepts(tokenizer, spec, xml_call("note", ("text", "")))
    assert not accepts(tokenizer, spec, xml_call("note", ("text", "abcde")))  # maxLength 4
    assert not accepts(tokenizer, spec, xml_call("note", ("x", "1")))  # an undeclared name
    # a value cannot hold the format's own tags: it would end early or nest
    assert not accepts(tokenizer, spec, xml_call("note", ("text", "a</parameter>")))
    # no declared properties: any names, any text
    assert accepts(tokenizer, spec, xml_call("free", ("a", "x y"), ("b", "[1]")))


@pytest.mark.parametrize("tool, exc, what", [
    (ToolSpec("t", {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}, strict=True,
              param="tools[3].function.parameters"), UnsupportedFeatureError, "pattern"),
    (ToolSpec("t", {"anyOf": [{"type": "object"}]}, strict=True, param="tools[3].function.parameters"),
     UnsupportedFeatureError, "anyOf"),
    (ToolSpec("t", {"type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}}, strict=True,
              param="tools[3].function.parameters"), InvalidRequestError, "schema"),
    (ToolSpec("bad name", {}, param="tools[3].function.parameters"), InvalidRequestError, "bad name"),
])
def test_qwen3_xml_refuses_what_it_cannot_express(tool, exc, what):
    with pytest.raises(exc) as info:
        qwen3_xml_grammar([tool], "required")
    assert info.value.param == "tools[3].function.parameters" and what in info.value.message


def test_hermes_checks_strict_schemas_and_keeps_refs(tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        hermes_grammar([ToolSpec("t", {"type": "objekt"}, strict=True, param="tools[2].input_schema")], "required")
    assert info.value.param == "tools[2].input_schema"
    with_refs = ToolSpec("t", {"$defs": {"c": {"enum": ["x", "y"]}}, "type": "object",
                               "properties": {"c": {"$ref": "#/$defs/c"}}, "required": ["c"]}, strict=True)
    spec = hermes_grammar([with_refs], "required")
    assert accepts(tokenizer, spec, json_call("t", {"c": "y"}))
    assert not accepts(tokenizer, spec, json_call("t", {"c": "z"}))


# -- random walks: whatever the grammar allows parses into a schema-valid call ----------------


def walk(tokenizer, spec: GuideSpec, rng: random.Random, limit: int = 1000) -> str:
    """One random output the grammar allows (mostly stopping at the first chance)."""
    tok, ll = tokenizer
    m = matcher(tokenizer, spec)
    ids: list[int] = []
    for _ in range(limit):
        if m.is_stopped():
            break
        mask = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:ll.vocab_size])
        others = allowed[allowed != ll.eos_token]
        if len(others) < len(allowed) and (rng.random() < 0.7 or not len(others)):
            break  # the model ends its output
        token = int(rng.choice(others))
        assert m.consume_token(token)
        ids.append(token)
    else:
        pytest.fail("the walk did not finish")
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_walk_of_a_required_grammar_parses_into_valid_calls(tokenizer, fmt):
    build, parser_cls = FORMATS[fmt]
    spec = build([WEATHER], "required")
    rng = random.Random(7)
    for _ in range(25):
        text = walk(tokenizer, spec, rng)
        leftover, calls = parse(parser_cls, [WEATHER], text)
        assert calls and not leftover.strip(), text
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(arguments, WEATHER_SCHEMA)
