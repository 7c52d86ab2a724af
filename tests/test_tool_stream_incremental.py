"""Tolerant tool-call parsing streams each call's arguments while the call is being written.

Parser level (both formats, char by char and in random chunkings) and the incremental
JSON re-serialiser behind hermes_json. tests/test_tool_stream_server.py drives the same
streaming through a real server, with a grammar making the tiny model write the calls.
"""

from __future__ import annotations

import json
import random

import pytest
from _split_helpers import assert_stream_equals_oneshot, chunkings, timeline

from ninfer.frontend.json_stream import JsonWriter
from ninfer.frontend.output_split import TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from ninfer.frontend.tool_schema import MAX_JSON_DEPTH, ToolSpec, dumps_json, loads_json
from ninfer_plugins.tool_parsers import hermes_json, qwen3_xml

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}})
WRITE = ToolSpec("write_file", {"type": "object", "properties": {"path": {"type": "string"}, "content": {}}})
TOOLS = [WEATHER, WRITE]


def xml(tolerant: bool = True):
    return lambda: qwen3_xml.Qwen3XmlToolParser(TOOLS, tolerant=tolerant)


def hermes(tolerant: bool = True):
    return lambda: hermes_json.HermesJsonToolParser(TOOLS, tolerant=tolerant)


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def char_by_char(make, text: str) -> list[tuple[int, object]]:
    """Each delta with the number of characters fed when it came out."""
    parser, out = make(), []
    for n in range(len(text)):
        out += [(n + 1, d) for d in parser.feed(text[n])]
    return out + [(len(text), d) for d in parser.finish()]


def sent_by(events, fed: int) -> str:
    """The arguments streamed once ``fed`` characters had gone in."""
    return "".join(d.fragment for n, d in events if isinstance(d, ToolCallArgs) and n <= fed)


def aggregate(make, text: str):
    parser = make()
    return timeline(parser.feed(text) + parser.finish()), parser.stats


# -- the arguments really stream ------------------------------------------------------


def test_xml_string_values_stream_as_they_are_written():
    text = "Saving.\n" + xml_call("write_file", ("path", "notes/a.txt"), ("content", 'say "hi"\nthen go'))
    events = char_by_char(xml(), text)
    kinds = [type(d) for _, d in events]
    assert kinds.count(ToolCallArgs) > 10 and kinds.index(ToolCallStart) < kinds.index(ToolCallEnd)
    second = text.index("<parameter=content>")
    assert sent_by(events, second) == '{"path": "notes/a.txt"'  # out before the next parameter is fed
    assert sent_by(events, text.index("then go")) == '{"path": "notes/a.txt", "content": "say \\"hi\\"'
    args = '{"path": "notes/a.txt", "content": "say \\"hi\\"\\nthen go"}'
    expected = [("text", "Saving."), ("call", "write_file", args)]
    assert timeline(d for _, d in events) == expected
    assert aggregate(xml(), text)[0] == expected == aggregate(xml(tolerant=False), text)[0]


def test_xml_values_whose_json_is_not_fixed_wait_for_their_closing_tag():
    text = xml_call("get_weather", ("days", "12"), ("metric", ""), ("extra", "[1, 2]"), ("other", "plain words"),
                    ("note", "null"))
    events = char_by_char(xml(), text)
    days_end = text.index("</parameter>")
    assert sent_by(events, days_end) == "{"  # an integer is written whole
    assert sent_by(events, days_end + len("</parameter>")) == '{"days": 12'
    extra_end = text.index("[1, 2]") + len("[1, 2]\n</parameter>") - 1
    assert sent_by(events, extra_end) == '{"days": 12'  # untyped JSON-looking text waits
    # untyped text that cannot be JSON streams; the empty boolean is omitted without a stray separator
    assert sent_by(events, text.index("words")) == '{"days": 12, "extra": [1, 2], "other": "plain '
    args = '{"days": 12, "extra": [1, 2], "other": "plain words", "note": "null"}'
    assert timeline(d for _, d in events) == [("call", "get_weather", args)]
    assert aggregate(xml(tolerant=False), text)[0] == [("call", "get_weather", args)]


def test_hermes_arguments_stream_in_canonical_form():
    raw = '{"path":"a\\u00e9\\/b",  "content" : "x\\ny\\ud83d\\ude00", "n":[1,2.50,{"k":true}], "e":{}}'
    text = "Ok.\n" + json_call("write_file", raw)
    events = char_by_char(hermes(), text)
    assert [type(d) for _, d in events].count(ToolCallArgs) > 10
    assert sent_by(events, text.index('"content"')) == '{"path": "aé/b"'
    args = '{"path": "aé/b", "content": "x\\ny😀", "n": [1, 2.5, {"k": true}], "e": {}}'
    assert args == dumps_json(loads_json(raw))
    expected = [("text", "Ok."), ("call", "write_file", args)]
    assert timeline(d for _, d in events) == expected == aggregate(hermes(tolerant=False), text)[0]


def test_hermes_name_after_arguments_releases_them_at_the_name():
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    events = char_by_char(hermes(), text)
    start = next(n for n, d in events if isinstance(d, ToolCallStart))
    assert start == text.index('"get_weather"') + len('"get_weather"')
    assert sent_by(events, start) == '{"city": "Oslo"}'
    assert timeline(d for _, d in events) == [("call", "get_weather", '{"city": "Oslo"}')]


def test_strict_mode_still_holds_calls_until_the_end():
    for make, text in [(xml(False), xml_call("get_weather", ("city", "Paris"), ("days", "2"))),
                       (hermes(False), json_call("get_weather", '{"city": "Paris", "days": 2}'))]:
        events = char_by_char(make, text)
        assert all(n == len(text) for n, d in events)
        assert [type(d) for _, d in events] == [ToolCallStart, ToolCallArgs, ToolCallEnd]


def test_parallel_calls_each_stream_in_turn():
    first = xml_call("get_weather", ("city", "Oslo"))
    text = first + "\n" + xml_call("write_file", ("path", "p"), ("content", "c"))
    events = char_by_char(xml(), text)
    calls = [(n, type(d), d.index) for n, d in events if not isinstance(d, TextDelta)]
    assert [i for _, _, i in calls] == sorted(i for _, _, i in calls)  # call 0 ends before call 1 starts
    assert [n for n, kind, _ in calls if kind is ToolCallEnd][0] == len(first)
    assert sum(kind is ToolCallArgs for _, kind, i in calls if i == 1) > 3
    assert timeline(d for _, d in events) == [("call", "get_weather", '{"city": "Oslo"}'),
                                              ("call", "write_file", '{"path": "p", "content": "c"}')]


SAMPLES = [
    (xml, "Let me look.\n\n" + xml_call("get_weather", ("city", "Zürich ✓"), ("days", "3"), ("metric", "TRUE"))),
    (xml, xml_call("write_file", ("content", "x <parameter=q>\n1\n</parameter> </tool_call>")) + "\nDone."),
    (xml, "See <tool_call> tags.\n" + xml_call("get_weather", ("note", "")) + "\n" + xml_call("write_file")),
    (hermes, json_call("get_weather", '{"city": "Pa\\"ris}", "n": [1, -0, 1e2, null]}') + "\n"
     + json_call("write_file", '{"content": "</tool_call>"}')),
    (hermes, "<tool_call> nope " + json_call("get_weather", '{"a": {"b": {}}}') + " tail"),
]


@pytest.mark.parametrize("maker, text", SAMPLES)
def test_every_chunking_streams_the_aggregate_and_matches_strict_arguments(maker, text):
    events = assert_stream_equals_oneshot(maker(), text)
    strict = [e for e in aggregate(maker(tolerant=False), text)[0] if e[0] == "call"]
    if strict:  # where strict mode keeps the calls, they carry the same arguments
        assert [e for e in events if e[0] == "call"] == strict


# -- a committed call that breaks -------------------------------------------------------

BROKEN = [
    # the output ends inside a string value: it keeps what was written
    (xml, "<tool_call>\n<function=write_file>\n<parameter=content>\nhello wor",
     [("call", "write_file", '{"content": "hello wor"}')]),
    # a held layout newline and partial closing tag are not value text
    (xml, "<tool_call>\n<function=write_file>\n<parameter=path>\nhello\n</param",
     [("call", "write_file", '{"path": "hello"}'), ("text", "</param")]),
    (xml, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1",
     [("call", "get_weather", '{"city": "Oslo"}'), ("text", "<parameter=days>\n1")]),
    (xml, xml_call("get_weather", ("city", "a"), ("city", "b")),
     [("call", "get_weather", '{"city": "a"}'),
      ("text", "<parameter=city>\nb\n</parameter>\n</function>\n</tool_call>")]),
    (xml, xml_call("get_weather", ("city", "a </parameter> b")) + "\n" + xml_call("get_weather", ("days", "1")),
     [("call", "get_weather", '{"city": "a "}'), ("text", "b\n</parameter>\n</function>\n</tool_call>"),
      ("call", "get_weather", '{"days": 1}')]),
    (xml, "<tool_call>\n<function=get_weather>\n<parameter=bad name>",
     [("call", "get_weather", "{}"), ("text", "<parameter=bad name>")]),
    (hermes, '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "hel',
     [("call", "write_file", '{"path": "a", "content": "hel"}')]),
    (hermes, '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "n": [1, {"k": 12',
     [("call", "write_file", '{"path": "a", "n": [1, {}]}'), ("text", '"k": 12')]),
    (hermes, json_call("get_weather", '{"city": "a", "metric": tru}'),
     [("call", "get_weather", '{"city": "a"}'), ("text", ', "metric": tru}}\n</tool_call>')]),
    (hermes, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "open\nmore prose',
     [("call", "get_weather", '{"city": "open"}'), ("text", "more prose")]),
    (hermes, '<tool_call>\n{"name": "get_weather", "argu', [("call", "get_weather", "{}"), ("text", ', "argu')]),
    (hermes, '<tool_call>\n{"name": "get_weather", "arguments": {}, "id": 7}\n</tool_call>',
     [("call", "get_weather", "{}"), ("text", ', "id": 7}\n</tool_call>')]),
]


@pytest.mark.parametrize("maker, text, expected", BROKEN)
def test_a_broken_committed_call_closes_with_what_streamed(maker, text, expected):
    assert assert_stream_equals_oneshot(maker(), text) == expected
    stats = aggregate(maker(), text)[1]
    assert stats.fallback_reason == "truncated_call" and stats.calls == sum(e[0] == "call" for e in expected)
    for _, arguments in [e[1:] for e in expected if e[0] == "call"]:
        json.loads(arguments)


@pytest.mark.parametrize("maker, text, reason", [
    (xml, xml_call("get_time", ("zone", "UTC")), "undeclared_tool"),
    (xml, "<tool_call>\n<function=get_weather>\nno markup here", "malformed_structure"),
    (hermes, json_call("get_time", '{"zone": "UTC"}'), "undeclared_tool"),
    (hermes, '<tool_call>\n{"id": 1, "name": "get_weather", "arguments": {}}\n</tool_call>', "malformed_structure"),
    (hermes, '<tool_call>\n{"arguments": [1], "name": "get_weather"}\n</tool_call>', "malformed_structure"),
])
def test_markup_that_never_commits_still_falls_back_byte_exactly(maker, text, reason):
    assert assert_stream_equals_oneshot(maker(), text) == [("text", text)]
    assert aggregate(maker(), text)[1].fallback_reason == reason


PROSE = "more prose " * 300


@pytest.mark.parametrize("make, text", [
    (xml(), "You can emit <tool_call> blocks, or <tool_call>\n<function=f> " + PROSE),
    (xml(), "<tool_call>\n<function=get_weather>\nno parameter here " + PROSE),
    (hermes(), "You can emit <tool_call> blocks, {like this} " + PROSE),
    (hermes(), '<tool_call>\n{"name": "f", "arguments": {"q": "open\n' + PROSE),
])
def test_a_literal_marker_in_prose_never_stalls(make, text):
    parser, fed, emitted, worst = make(), 0, 0, 0
    for ch in text:
        fed += 1
        emitted += sum(len(d.text) for d in parser.feed(ch) if isinstance(d, TextDelta))
        worst = max(worst, fed - emitted)
    assert worst <= 64
    assert emitted + sum(len(d.text) for d in parser.finish() if isinstance(d, TextDelta)) == len(text)


# -- the incremental JSON re-serialiser ------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "num", "lit"] + (["obj", "arr"] * 2 if depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\té😀\u2028\x01') for _ in range(rng.randint(0, 6)))
    if kind == "num":
        return rng.choice([0, -7, 12345678901234567890, 2.5, -0.0, 1e-7, 3.0])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}" + rng.choice(["", "é", '"']): _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _render(rng: random.Random, value) -> str:
    """JSON for ``value`` with random spacing and escapes, as a model might write it."""
    space = lambda: rng.choice(["", "", " ", "\n  "])  # noqa: E731
    if isinstance(value, dict):
        members = [f"{space()}{_render(rng, k)}{space()}:{space()}{_render(rng, v)}" for k, v in value.items()]
        return "{" + ",".join(members) + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + _render(rng, v) for v in value) + space() + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=rng.random() < 0.5).replace("/", rng.choice(["/", "\\/"]))
    if isinstance(value, float) and value == 2.5:
        return rng.choice(["2.5", "2.50", "25e-1", "0.25E+1"])
    return json.dumps(value)


def _write(chunks: list[str]) -> tuple[JsonWriter, str]:
    """The writer fed ``chunks`` one by one, and what it wrote."""
    writer, buf, pieces = JsonWriter(0), "", []
    for chunk in chunks:
        buf += chunk
        writer.feed(buf)
        pieces.append(writer.take())
    assert "".join(pieces) == writer.text()
    return writer, writer.text()


@pytest.mark.parametrize("seed", range(40))
def test_json_writer_equals_parse_then_dump(seed):
    rng = random.Random(seed)
    text = _render(rng, {"v": _random_value(rng), "w": _random_value(rng)})
    canonical = dumps_json(loads_json(text))
    for chunks in list(chunkings(text, seed=seed, random_runs=3))[-4:]:  # char by char and random
        writer, out = _write(chunks)
        assert writer.done and out == canonical and writer.consumed == len(text)
    # damaged text: the writer fails, or stops early, and what it wrote closes into valid JSON
    for _ in range(10):
        k = rng.randrange(len(text))
        damaged = rng.choice([text[:k], text[:k] + text[k + 1:], text[:k] + rng.choice('x,:]}"\\') + text[k:]])
        writer, out = _write([damaged])
        assert _write(list(damaged))[1] == out
        if writer.done:
            assert out == dumps_json(loads_json(damaged[:writer.pos]))
            continue
        if out:  # nothing is written when the very first character rules the text out
            json.loads(out + writer.closers())
        with pytest.raises(ValueError):
            loads_json(damaged)


# -- JSON no parse can return: too deep, or a lone surrogate --------------------------


DEEP = '{"a": ' + "[" * 1000 + "]" * 1000 + "}"  # past Python's recursion limit, let alone MAX_JSON_DEPTH


@pytest.mark.parametrize("text, error", [
    (DEEP, "JSONTooDeepError"),
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "JSONTooDeepError"),
    ('{"a": "x\\ud800"}', "LoneSurrogateError"),
    ('{"\\udc00": 1}', "LoneSurrogateError"),
])
def test_unreadable_json_is_a_value_error_in_the_parse_and_the_writer(text, error):
    """Both refuse it, so a model's call falls back to text instead of failing the request."""
    with pytest.raises(ValueError) as refused:
        loads_json(text)
    assert type(refused.value).__name__ == error
    assert _write(list(text))[0].failed and _write([text])[0].failed
    # the limits themselves still parse, and a surrogate pair is one character
    assert loads_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert loads_json('"\\ud83d\\ude00"') == "😀" and _write(['"\\ud83d', '\\ude00"'])[1] == '"😀"'


@pytest.mark.parametrize("arguments", [DEEP, '{"city": "\\ud800"}'])
def test_model_calls_no_parse_can_return_break_like_invalid_json(arguments):
    """A strict parser falls back to the text; a tolerant one, already streaming the call,
    closes it with what streamed (as for any invalid JSON) and keeps the rest as text."""
    text = json_call("get_weather", arguments)
    assert assert_stream_equals_oneshot(hermes(False), text) == [("text", text)]
    events = assert_stream_equals_oneshot(hermes(True), text)
    assert [e[0] for e in events] == ["call", "text"] and isinstance(loads_json(events[0][2]), dict)
    assert aggregate(hermes(True), text)[1].fallback_reason == "truncated_call"
