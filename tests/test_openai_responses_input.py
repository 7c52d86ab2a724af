"""Responses request side without a server: Items, history, tools, prompts, store, transcripts."""

from __future__ import annotations

import json

import pytest
from loguru import logger

from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer
from ninfer_plugins.protocols.openai_responses.history import lower_items
from ninfer_plugins.protocols.openai_responses.items import canonical_input
from ninfer_plugins.protocols.openai_responses.prepare import PromptContext, prepare
from ninfer_plugins.protocols.openai_responses.schema import CreateRequest, decode
from ninfer_plugins.protocols.openai_responses.sealed import seal
from ninfer_plugins.protocols.openai_responses.store import ResponseStore, StoreCapacityError, StoredResponse
from ninfer_plugins.protocols.openai_responses.tools import resolve_tools
from ninfer_plugins.protocols.openai_responses.transcript import Transcript, added_markers, encode_prompt
from _hosts import tokenizer_pipeline


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from importlib import resources

    template = resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")
    return Tokenizer(build_tokenizer(), templates={"default": template}, special_tokens={"eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def ctx(tokenizer) -> PromptContext:
    return PromptContext.of(tokenizer_pipeline(tokenizer))


def items(raw, **kw):
    return canonical_input(raw, has_parent=kw.get("has_parent", False), unique_ids=kw.get("unique_ids", True))


def lower(raw):
    return lower_items([(item, f"input[{i}]") for i, item in enumerate(items(raw))])


def fails(fn, *args, code=None, param=None, kind=InvalidRequestError):
    with pytest.raises(kind) as info:
        fn(*args)
    assert code is None or info.value.code == code, info.value.code
    assert param is None or info.value.param == param, info.value.param
    return info.value


FC = {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def result(call_id, text="ok", **kw):
    return {"type": "function_call_output", "call_id": call_id, "output": text, **kw}


# -- Items ------------------------------------------------------------------------------


def test_string_and_empty_input():
    (item,) = items("hi")
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "hi"}]
    assert item["id"].startswith("msg_")
    assert items([])[0]["content"][0]["text"] == "" and items(None)[0]["role"] == "user"  # a bare probe
    assert items([], has_parent=True) == [] and items(None, has_parent=True) == []


def test_ids_are_kept_or_made_and_duplicates_fail_only_when_stored():
    raw = [{"role": "user", "content": "a", "id": "m1"}, {"type": "message", "role": "user", "content": "b"}]
    first, second = items(raw)
    assert first["id"] == "m1" and second["id"].startswith("msg_")
    twice = [raw[0], raw[0]]
    fails(items, twice, param="input[1].id")
    assert len(canonical_input(twice, has_parent=False, unique_ids=False)) == 2


@pytest.mark.parametrize("entry, param, kind, code", [
    ({"type": "item_reference", "id": "x"}, "input[0].type", UnsupportedFeatureError, None),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0].type",
     UnsupportedFeatureError, None),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}, "input[0].content[0]",
     InvalidRequestError, "vision_disabled"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "high"}]},
     "input[0].content[0].detail", UnsupportedFeatureError, None),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input[0].content[0].type",
     InvalidRequestError, None),
    ({"role": "tool", "content": "x"}, "input[0].role", InvalidRequestError, None),
    ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, "input[0].content",
     UnsupportedFeatureError, None),
    ({"type": "reasoning", "encrypted_content": "gAAAAforeign"}, "input[0].encrypted_content",
     UnsupportedFeatureError, None),
    ({**FC, "call_id": "c", "arguments": "[1]"}, "input[0].arguments", InvalidRequestError, None),
    # JSON no decoder or tokenizer can take (these were 500s)
    ({**FC, "call_id": "c", "arguments": '{"a":' * 1000 + "1" + "}" * 1000}, "input[0].arguments",
     InvalidRequestError, None),
    ({**FC, "call_id": "c", "arguments": '{"a": "\\ud800"}'}, "input[0].arguments", InvalidRequestError, None),
    ({**FC, "call_id": "c", "status": "in_progress"}, "input[0].status", UnsupportedFeatureError, None),
    ({**FC}, "input[0].call_id", InvalidRequestError, None),
    (result("c", []), "input[0].output", InvalidRequestError, None),
    ({"role": "user", "content": [{"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "x"}}]},
     "input[0].content[0].prompt_cache_breakpoint", InvalidRequestError, None),
    # a type that is not a string (found by the OpenAPI fuzzer: it was a 500)
    ({"role": "user", "type": [{"x": 1}]}, "input[0].type", InvalidRequestError, None),
    ({"role": "user", "content": [{"type": {"x": 1}}]}, "input[0].content[0].type", InvalidRequestError, None),
])
def test_malformed_or_unsupported_items_name_their_field(entry, param, kind, code):
    fails(items, [entry], param=param, kind=kind, code=code)


def test_reasoning_replay_from_raw_text_or_this_servers_envelope():
    raw = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "step "},
                                            {"type": "reasoning_text", "text": "two"}]}
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": seal("kept\nexactly ")}
    foreign = {**raw, "encrypted_content": "gAAAAforeign", "summary": [{"type": "summary_text", "text": "s"}]}
    a, b, c = items([raw, sealed, foreign])
    assert a["content"] == [{"type": "reasoning_text", "text": "step two"}] and a["id"].startswith("rs_")
    assert b["content"][0]["text"] == "kept\nexactly " and b["encrypted_content"] == sealed["encrypted_content"]
    assert c["content"][0]["text"] == "step two" and c["summary"] == foreign["summary"]
    fails(items, [{**raw, "encrypted_content": seal("other")}], param="input[0].encrypted_content")


# -- history ------------------------------------------------------------------------------


def test_assistant_items_group_into_one_turn_and_results_follow_call_order():
    turns = lower([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"},
                                                             {"type": "refusal", "refusal": "b"}]},
        {**FC, "call_id": "c1"},
        {**FC, "call_id": "c2", "namespace": "crm"},
        result("c2", "two", namespace="crm", name="get_weather"),
        result("c1", [{"type": "input_text", "text": "o"}, {"type": "input_text", "text": "ne"}]),
        {"role": "developer", "content": "mid"},
    ])
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "tool", "developer"]
    assistant = turns[2]
    assert (assistant.reasoning, assistant.content) == ("r", "ab")
    assert [(c.id, c.name) for c in assistant.tool_calls] == [("c1", "get_weather"), ("c2", "crm.get_weather")]
    assert [(t.tool_call_id, t.content) for t in turns[3:5]] == [("c1", "one"), ("c2", "two")]


def test_reasoning_only_and_unanswered_calls_are_kept():
    turns = lower([{"role": "user", "content": "q"},
                   {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
                   {"role": "user", "content": "q2"}, {**FC, "call_id": "c1"}, {"role": "user", "content": "q3"}])
    assert [t.role for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert turns[1].reasoning == "r" and turns[1].content == "" and turns[3].tool_calls[0].id == "c1"


@pytest.mark.parametrize("raw, code, param", [
    ([{**FC, "call_id": "c1"}, {"type": "message", "role": "assistant", "content": "late"}],
     "invalid_assistant_history", "input[1]"),
    ([{"type": "message", "role": "assistant", "content": "a"},
      {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}], "invalid_assistant_history",
     "input[1]"),
    ([result("nobody")], "invalid_tool_history", "input[0]"),
    ([{**FC, "call_id": "c1"}, result("c1"), result("c1")], "invalid_tool_history", "input[2]"),
    ([{**FC, "call_id": "c1"}, {**FC, "call_id": "c2"}, result("c1"), {"role": "user", "content": "u"}],
     "invalid_tool_history", "input[2]"),
    ([{**FC, "call_id": "c1"}, {**FC, "call_id": "c1"}], "invalid_tool_history", "input[1]"),
    ([{**FC, "call_id": "c1"}, result("c1", name="other")], "invalid_tool_history", "input[1].name"),
    ([{**FC, "call_id": "c1"}, {"role": "user", "content": "u"}, result("c1")], "invalid_tool_history", "input[2]"),
])
def test_unrepresentable_histories_fail(raw, code, param):
    fails(lower, raw, code=code, param=param)


# -- tools ------------------------------------------------------------------------------


NS = {"type": "namespace", "name": "crm", "description": "Customer records",
      "tools": [{"type": "function", "name": "lookup", "description": "Find one", "parameters": {"type": "object"}}]}
DIRECT = {"type": "function", "name": "lookup", "strict": False}


def test_namespaces_get_their_own_identity_and_hosted_tools_are_left_out():
    records: list[str] = []
    sink = logger.add(lambda m: records.append(m.record["message"]), level="WARNING")
    try:
        tools = resolve_tools([DIRECT, NS, {"type": "web_search", "external_web_access": False}], "auto", True)
    finally:
        logger.remove(sink)
    assert [d["function"]["name"] for d in tools.definitions] == ["lookup", "crm.lookup"]
    assert tools.definitions[1]["function"]["description"] == "Customer records\n\nFind one"
    assert (tools.identities["crm.lookup"].namespace, tools.identities["crm.lookup"].name) == ("crm", "lookup")
    assert any("web_search" in r for r in records)
    allowed = resolve_tools([DIRECT, NS], {"type": "allowed_tools", "mode": "auto",
                                           "tools": [{"type": "function", "namespace": "crm", "name": "lookup"}]}, None)
    assert list(allowed.identities) == ["crm.lookup"]
    none = resolve_tools([DIRECT, NS], "none", False)
    assert none.definitions == [] and none.identities == {}


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ([DIRECT, {"type": "web_search"}], {"type": "web_search"}, None, "tool_choice"),
    ([DIRECT], "always", None, "tool_choice"),
    ([DIRECT, NS], {"type": "function", "name": "lookup", "namespace": "other"}, None, "tool_choice.name"),
    ([DIRECT], {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]}, None,
     "tool_choice.tools[0]"),
    ([DIRECT], {"type": "allowed_tools", "mode": "sometimes", "tools": []}, None, "tool_choice.mode"),
    ([DIRECT], {"type": "allowed_tools", "tools": [{"type": "function", "name": "nope"}]}, None,
     "tool_choice.tools[0]"),
    ([{**DIRECT, "strict": "yes"}], None, None, "tools[0].strict"),
    ([{"type": "custom", "name": "patch"}], None, None, "tools[0].type"),
    ([DIRECT, DIRECT], None, None, "tools[1]"),
    ([{"type": "function", "name": "crm.lookup"}, NS], None, None, "tools[1].tools[0]"),
    ([{**DIRECT, "defer_loading": True}], None, None, "tools[0].defer_loading"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "x"}]}], None, None,
     "tools[0].tools[0].type"),
    ([{"type": "mystery"}], None, None, "tools[0].type"),
    ([{"type": ["function"]}], None, None, "tools[0].type"),
    ([DIRECT], {"type": ["function"]}, None, "tool_choice.type"),
    # names no tool call can carry fail whatever tool_choice, not only where a grammar forces a call
    ([{"type": "function", "name": "get weather"}], None, None, "tools[0].name"),
    ([{"type": "namespace", "name": "my<ns>", "tools": [DIRECT]}], "auto", None, "tools[0].name"),
])
def test_tool_configurations_that_cannot_be_honoured_fail(tools, choice, parallel, param):
    fails(resolve_tools, tools, choice, parallel, param=param)


def test_parallel_false_is_fine_without_callable_tools():
    assert resolve_tools([DIRECT], "none", False).definitions == []


# -- prompts ----------------------------------------------------------------------------


def req(**kw) -> CreateRequest:
    return decode(json.dumps({"model": "m", **kw}).encode(), CreateRequest)


def test_prompt_keeps_positions_puts_instructions_first_and_renders_namespaced_calls(ctx):
    prepared = prepare(req(instructions="INSTR", tools=[NS], input=[
        {"role": "user", "content": "q"},
        {**FC, "name": "lookup", "namespace": "crm", "call_id": "c1"},
        result("c1", "found"),
        {"role": "developer", "content": "DEV"},
    ]), ctx, None, True)
    p = prepared.prompt
    assert p.startswith("<|im_start|>system\nINSTR\n\n# Tools") and '"name": "crm.lookup"' in p
    assert p.index('{"name": "crm.lookup", "arguments": {"city": "Oslo"}}') < p.index("found") < p.index("DEV")
    assert p.index("DEV") > p.index("<|im_start|>user\nq")
    assert prepared.prompt_ids == ctx.tokenizer.encode(p)
    assert [i["type"] for i in prepared.input_items] == ["message", "function_call", "function_call_output",
                                                        "message"]


def test_preserve_thinking_is_inherited_and_conflicts_fail(ctx):
    parent = StoredResponse({}, [], (), 0, True, Transcript.of("", [], [], ctx.tokenizer))
    assert prepare(req(input="x"), ctx, parent, True).options.preserve_thinking is True
    assert prepare(req(input="x", preserve_thinking=False), ctx, parent, True).options.preserve_thinking is False
    assert prepare(req(input="x"), ctx, None, True).options.preserve_thinking is False
    fails(prepare, req(input="x", preserve_thinking=True, chat_template_kwargs={"preserve_thinking": False}), ctx,
          None, True, code="conflicting_template_option")
    assert prepare(req(input="x", reasoning={"effort": "none"}), ctx, None, True).prompt.endswith(
        "<think>\n\n</think>\n\n")
    fails(prepare, req(input="x", reasoning={"effort": "high"}), ctx, None, True,
          code="reasoning_effort_not_supported", param="reasoning.effort")


# -- transcripts --------------------------------------------------------------------------


def test_a_continuation_reuses_the_parents_exact_tokens(tokenizer):
    markers = added_markers(tokenizer)
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    output_ids = tokenizer.encode("h") + tokenizer.encode("ello") + tokenizer.encode("<|im_end|>")
    assert tokenizer.encode("hello") != output_ids[:-1]  # not the canonical encoding
    parent = Transcript.of(prompt, tokenizer.encode(prompt), output_ids, tokenizer)
    child = prompt + "hello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    ids = encode_prompt(child, tokenizer, markers, parent)
    assert ids[: len(parent.prompt_ids) + len(output_ids)] == [*parent.prompt_ids, *output_ids]
    assert tokenizer.decode(ids, skip_special_tokens=False) == child
    changed = child.replace("hello", "jello")
    assert encode_prompt(changed, tokenizer, markers, parent) == tokenizer.encode(changed)


# -- store ------------------------------------------------------------------------------


def record(tokenizer, text: str = "") -> StoredResponse:
    return StoredResponse({"id": "r", "pad": text}, [], (), 0, False, Transcript.of("", [], [], tokenizer))


def test_store_evicts_least_recently_used_by_count_and_bytes(tokenizer):
    store = ResponseStore(max_records=2, max_mib=1)
    store.put("a", record(tokenizer))
    store.put("b", record(tokenizer))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", record(tokenizer))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put("big", record(tokenizer, "x" * 700_000))
    store.put("big2", record(tokenizer, "x" * 700_000))
    assert store.get("big") is None and store.get("big2") is not None and store.bytes <= store.max_bytes
    assert store.delete("big2") and not store.delete("big2") and store.bytes == 0
    with pytest.raises(StoreCapacityError) as info:
        store.put("huge", record(tokenizer, "x" * (1 << 20)))
    assert info.value.code == "response_store_capacity_exceeded"


def test_explicit_cache_breakpoints_mark_the_turns_they_end():
    """A part's prompt_cache_breakpoint marks the end of its Item's rendered turn; an Item the
    next one joins (a call beside its assistant text) has no exact boundary; the implicit
    candidate takes one of the four write slots unless it coincides with a mark."""
    from ninfer_plugins.protocols.openai_responses.items import canonical_input
    from ninfer_plugins.protocols.openai_responses.prepare import explicit_breakpoints

    def user(text, mark=False):
        part = {"type": "input_text", "text": text, **({"prompt_cache_breakpoint": {"mode": "explicit"}} if mark else {})}
        return {"role": "user", "content": [part]}

    raw = [user("system-like context", mark=True), {"role": "assistant", "content": "ok"}, user("question", mark=True)]
    items = canonical_input(raw, has_parent=False, unique_ids=False)
    located = [(item, f"input[{i}]") for i, item in enumerate(items)]
    assert explicit_breakpoints(raw, located, 0, 0, implicit=3) == (1, 3)
    assert explicit_breakpoints(raw, located, 0, 1, implicit=None) == (2, 4)  # instructions render first
    many = [user(str(i), mark=True) if i % 2 == 0 else {"role": "assistant", "content": "a"} for i in range(11)]
    items = canonical_input(many, has_parent=False, unique_ids=False)
    located = [(item, "x") for item in items]
    assert explicit_breakpoints(many, located, 0, 0, implicit=None) == (5, 7, 9, 11)
    assert explicit_breakpoints(many, located, 0, 0, implicit=12) == (7, 9, 11)
    assert explicit_breakpoints("just text", [], 0, 0, implicit=1) == ()
