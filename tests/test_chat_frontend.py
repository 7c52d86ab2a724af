"""Protocol-neutral chat front end: message normalisation and chat-template capabilities."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.chat_messages import ChatTurn, ToolCall, parse_messages, template_messages
from ninfer.frontend.template_caps import detect_caps
from ninfer.tokenizer import compile_template

TINY_TEMPLATE = resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def render(messages, **kwargs) -> str:
    turns = template_messages(parse_messages(messages))
    return compile_template(TINY_TEMPLATE).render(messages=turns, add_generation_prompt=True, tools=None, **kwargs)


# -- messages ---------------------------------------------------------------------------


def test_text_parts_join_without_separators_and_empty_content_stays_a_turn():
    turns = parse_messages([
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]},
        {"role": "user", "content": None},
    ])
    assert [(t.role, t.content) for t in turns] == [("system", "be brief"), ("user", ""), ("assistant", "ab"),
                                                     ("user", "")]
    assert render([{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}]) \
        == render([{"role": "user", "content": "hello"}])


def test_developer_renders_as_system_in_place():
    text = render([{"role": "user", "content": "u1"}, {"role": "developer", "content": "dev"},
                   {"role": "user", "content": "u2"}])
    assert text.index("u1") < text.index("<|im_start|>system\ndev<|im_end|>") < text.index("u2")


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_history_aliases(key):
    turns = parse_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "why"}])
    assert turns[1].reasoning == "why"
    assert "<think>\nwhy\n</think>" in render([{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a", key: "why"}])


def test_disagreeing_reasoning_aliases_are_rejected():
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "assistant", "content": "", "reasoning_content": "a", "reasoning": "b"}])
    assert e.value.param == "messages[0].reasoning"


def test_tool_calls_keep_argument_member_order_string_or_object():
    args = '{"zeta": 1, "alpha": {"y": 2, "x": 3}}'
    for arguments in (args, json.loads(args)):
        msgs = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"}]
        out = template_messages(parse_messages(msgs))
        assert list(out[1]["tool_calls"][0]["function"]["arguments"]) == ["zeta", "alpha"]
        text = render(msgs)
        assert '{"name": "f", "arguments": {"zeta": 1, "alpha": {"y": 2, "x": 3}}}' in text
        assert "<tool_response>\n42\n</tool_response>" in text


def test_legacy_function_history_matches_tool_history():
    legacy = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a": 1}'}},
              {"role": "function", "name": "f", "content": "r"}]
    modern = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
              {"role": "tool", "content": "r"}]
    assert render(legacy) == render(modern)
    assert parse_messages(legacy)[1].tool_calls == [ToolCall("", "f", '{"a": 1}')]


def test_tool_message_name_is_ignored_but_must_be_a_string():
    base = [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}]
    named = [base[0], {**base[1], "name": "anything"}]
    assert render(named) == render(base)
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([base[0], {**base[1], "name": 7}])
    assert e.value.param == "messages[1].name"


def test_participant_names_on_other_roles_are_unsupported_unless_empty():
    assert parse_messages([{"role": "user", "content": "q", "name": ""}]) == [ChatTurn("user", "q")]
    with pytest.raises(UnsupportedFeatureError) as e:
        parse_messages([{"role": "user", "content": "q", "name": "bob"}])
    assert e.value.param == "messages[0].name"


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "messages[0].content[0]", "vision_disabled"),
        ({"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}, "messages[0].content[0]", "vision_disabled"),
        ({"type": "image_url", "image_url": {"url": "https://x", "detail": "high"}},
         "messages[0].content[0].image_url.detail", "unsupported_parameter"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages[0].content[0].type",
         "unsupported_parameter"),
        ({"type": "file", "file": {"file_id": "f"}}, "messages[0].content[0].type", "unsupported_parameter"),
        ({"type": "banana"}, "messages[0].content[0].type", "invalid_request"),
        ({"type": ["text"]}, "messages[0].content[0].type", "invalid_request"),  # not a lookup key
    ],
)
def test_content_parts_we_cannot_take_name_their_field(part, param, code):
    with pytest.raises(InvalidRequestError) as e:
        parse_messages([{"role": "user", "content": [part]}])
    assert (e.value.param, e.value.code) == (param, code)


def test_malformed_messages_name_their_field():
    cases = [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "function", "content": "x"}], "messages[0].name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": "{}"}}]}],
         "messages[0].tool_calls[0].function.name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
         "messages[0].tool_calls[0].function.arguments"),
    ]
    for messages, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            parse_messages(messages)
        assert e.value.param == param


# -- template capabilities -----------------------------------------------------------------


def test_tiny_template_capabilities():
    caps = detect_caps(TINY_TEMPLATE)
    assert caps.enable_thinking and caps.preserve_thinking
    assert caps.efforts == () and caps.default_effort is None


def test_effort_values_are_the_literals_the_template_compares():
    source = (
        "{%- set effort = reasoning_effort | default('medium') -%}"
        "{%- if effort == 'low' %}L{% elif effort in ['medium', 'xhigh'] %}M{% endif -%}"
        "{%- if 'low' != reasoning_effort %}{% endif %}{{ enable_thinking }}"
    )
    caps = detect_caps(source)
    assert caps.efforts == ("low", "medium", "xhigh")
    assert caps.default_effort == "medium"
    assert caps.enable_thinking and not caps.preserve_thinking


def test_template_without_effort_or_switches():
    caps = detect_caps("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert caps == detect_caps("{{ messages }}") and not caps.enable_thinking and caps.efforts == ()
    assert detect_caps("").efforts == ()


# -- template options -----------------------------------------------------------------------


def test_template_options_resolve_once_for_both_effort_rules():
    """OpenAI's effort switches thinking; Anthropic's applies only while thinking. Both resolve here."""
    from ninfer.frontend.prompt_options import TemplateOptions, resolve_options

    caps = detect_caps("{%- set e = reasoning_effort | default('medium') -%}{% if e == 'low' %}{% endif %}"
                       "{{ enable_thinking }}{{ preserve_thinking }}")
    openai = resolve_options(TemplateOptions(effort="low"), caps, thinking_default=False, preserve_default=False)
    assert (openai.thinking, openai.effort) == (True, "low")  # the effort turned thinking on
    with pytest.raises(InvalidRequestError) as e:
        resolve_options(TemplateOptions(effort="low", enable=False), caps, True, False)
    assert e.value.code == "conflicting_template_option"
    anthropic = dict(effort="low", effort_param="output_config.effort", effort_enables=False)
    off = resolve_options(TemplateOptions(enable=False, **anthropic), caps, True, False)
    assert (off.thinking, off.effort) == (False, None)  # thinking off: the effort does not apply, no conflict
    on = resolve_options(TemplateOptions(**anthropic), caps, True, False)
    assert (on.thinking, on.effort) == (True, "low")  # the server's default thinking, with the effort
    with pytest.raises(InvalidRequestError) as e:
        resolve_options(TemplateOptions(**{**anthropic, "effort": "high"}), caps, True, False)
    assert (e.value.param, e.value.code) == ("output_config.effort", "reasoning_effort_not_supported")
    prefill = resolve_options(TemplateOptions(thinking_default=False, preserve_default=True), caps, True, False)
    assert (prefill.thinking, prefill.preserve_thinking) == (False, True)  # the request's defaults win
