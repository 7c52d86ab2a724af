"""The Responses endpoints against a real ``ninfer-serve`` process, through the openai SDK.

Two module-scoped servers on the tiny model: one for the protocol, one with a tiny
response store for its limits. Rendering of reasoning and tool markup the random model
rarely writes is in tests/test_openai_responses_render.py; the Codex request shape is
in tests/test_openai_responses_codex.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import server_fixture

from ninfer_plugins.protocols.openai_responses.sealed import seal

server = server_fixture("--max-context", "1024", "--default-thinking-budget", "64")
small_store = server_fixture("--max-context", "1024", "--response-store-max-records", "2",
                             "--response-store-max-mib", "1")
MODEL = "tiny:qwen3"
PAGE = 16  # the engine's KV page size: reuse is counted in whole pages


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


EXTENSIONS = ("preserve_thinking", "chat_template_kwargs")


def _sdk_args(kw: dict) -> dict:
    """The SDK takes our extensions only through ``extra_body``."""
    extra = {k: kw.pop(k) for k in EXTENSIONS if k in kw}
    return {**kw, "extra_body": extra} if extra else kw


def create(client, **kw):
    return client.responses.create(**_sdk_args({"model": MODEL, "max_output_tokens": 8, **kw}))


def count(client, **kw) -> int:
    return client.responses.input_tokens.count(**_sdk_args({"model": MODEL, **kw})).input_tokens


def error_of(call, *args, **kw) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call(*args, **kw)
    return {"status": info.value.status_code, **info.value.body}


def raw_stream(server, body: dict) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    """POST a streamed Create; returns the response and its (event name, JSON) pairs."""
    with httpx.stream("POST", f"{server}/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
            events.append((lines[0][7:], json.loads(lines[1][6:])))
    return r, events


def test_create_retrieve_list_and_delete(client):
    response = create(client, instructions="Be brief.", metadata={"k": "v"}, input=[
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a river."}],
         "id": "msg_mine"},
    ])
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status in ("completed", "incomplete") and response.metadata == {"k": "v"}
    assert response.output and response.output[0].type == "message" and isinstance(response.output_text, str)
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens >= 0
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()

    listed = client.responses.input_items.list(response.id)  # newest first by default
    assert [(i.role, i.id) for i in listed.data][0] == ("user", "msg_mine")
    assert listed.data[1].role == "developer" and listed.data[1].id.startswith("msg_") and not listed.has_more
    page = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert [i.role for i in page.data] == ["developer"] and page.has_more and page.last_id == page.first_id
    rest = client.responses.input_items.list(response.id, order="asc", after=page.last_id)
    assert [i.id for i in rest.data] == ["msg_mine"] and not rest.has_more

    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        err = error_of(call, response.id)
        assert err["status"] == 404 and err["code"] == "response_not_found"


def test_stream_lifecycle_and_stored_result(server):
    r, events = raw_stream(server, {"input": "Tell me a story.", "max_output_tokens": 10})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    assert all(name == e["type"] for name, e in events)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-1] in ("response.completed", "response.incomplete") and names.count(names[-1]) == 1
    final = events[-1][1]["response"]
    text = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    assert text == final["output"][-1]["content"][0]["text"]
    ids = {e["item_id"] for name, e in events if name.endswith(".delta")}
    assert ids == {final["output"][-1]["id"]}
    created = events[0][1]["response"]
    assert created["id"] == final["id"] and created["status"] == "in_progress" and created["usage"] is None
    assert httpx.get(f"{server}/v1/responses/{final['id']}").json() == final


def test_sdk_stream_helpers(client):
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=6) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == last.response.output_text
    with create(client, input="Hello", stream=True) as stream:
        kinds = [e.type for e in stream]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_previous_response_chain_reuses_the_first_turns_tokens(client):
    # greedy, so the output is the same every run (the tiny model's is random text)
    first = create(client, input="Tell me about rivers in Europe, please.", max_output_tokens=20, temperature=0,
                   preserve_thinking=True, instructions="Answer in French.")
    second = create(client, input="And in Asia?", previous_response_id=first.id, max_output_tokens=4,
                    instructions="Answer in French.")  # preserve_thinking is inherited
    spoken = first.usage.input_tokens + first.usage.output_tokens
    # the last generated token was never fed back, so its KV (and its page) is not held
    assert second.usage.input_tokens_details.cached_tokens >= (spoken - 1) // PAGE * PAGE
    assert second.usage.input_tokens > spoken
    assert count(client, input="And in Asia?", previous_response_id=first.id,
                 instructions="Answer in French.") == second.usage.input_tokens


def test_instructions_are_not_carried_forward(client):
    first = create(client, input="hi", instructions="Answer in French, always, whatever happens.")
    chained = count(client, input="more", previous_response_id=first.id)
    replayed = [{"role": "user", "content": "hi"}, *[o.model_dump(exclude_none=True) for o in first.output],
                {"role": "user", "content": "more"}]
    assert chained == count(client, input=replayed)
    assert count(client, input=replayed, instructions="Answer in French, always, whatever happens.") > chained


def test_store_false_is_neither_retrievable_nor_continuable(client):
    response = create(client, input="hi", store=False)
    assert response.store is False
    assert error_of(client.responses.retrieve, response.id)["code"] == "response_not_found"
    err = error_of(create, client, input="more", previous_response_id=response.id)
    assert (err["status"], err["code"], err["param"]) == (404, "response_not_found", "previous_response_id")


def test_descendants_survive_deleting_their_parent(client):
    a = create(client, input="one")
    b = create(client, input="two", previous_response_id=a.id)
    client.responses.delete(a.id)
    c = create(client, input="three", previous_response_id=b.id, max_output_tokens=1)
    assert c.previous_response_id == b.id
    assert count(client, input="three", previous_response_id=b.id) > count(client, input="three")


def test_reasoning_replay_from_the_envelope_renders_like_raw_text(client):
    def history(reasoning: dict) -> list:
        return [{"role": "user", "content": "q"}, reasoning,
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
                {"role": "user", "content": "next"}]

    raw = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "careful\nthought"}]}
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": seal("careful\nthought")}
    counts = {k: count(client, input=history(v), preserve_thinking=True) for k, v in (("raw", raw), ("sealed", sealed))}
    bare = count(client, input=[h for h in history(raw) if h.get("type") != "reasoning"], preserve_thinking=True)
    assert counts["raw"] == counts["sealed"] > bare
    response = create(client, input=history(sealed), store=False, include=["reasoning.encrypted_content"],
                      reasoning={"summary": "auto"})
    assert response.status in ("completed", "incomplete")


def test_tools_namespaces_and_hosted_tools(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}},
             {"type": "namespace", "name": "crm", "description": "Customer records",
              "tools": [{"type": "function", "name": "get_weather", "description": "At a customer"}]},
             {"type": "web_search"}]
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "namespace": "crm",
                "arguments": '{"id": 7}'},
               {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c2", "output": "sunny"},
               {"type": "function_call_output", "call_id": "c1", "output": "rainy", "namespace": "crm"}]
    response = create(client, input=history, tools=tools, max_output_tokens=1)
    assert response.usage.input_tokens == count(client, input=history, tools=tools)
    listed = client.responses.input_items.list(response.id, order="asc")
    assert [i.type for i in listed.data][1:] == ["function_call", "function_call", "function_call_output",
                                                 "function_call_output"]
    assert listed.data[1].namespace == "crm" and listed.data[1].id.startswith("fc_")
    err = error_of(create, client, input="x", tools=tools, tool_choice={"type": "web_search"})
    assert (err["status"], err["param"]) == (400, "tool_choice")
    err = error_of(create, client, input=history[:4], tools=tools)
    assert (err["code"], err["param"]) == ("invalid_tool_history", "input[3]")


def test_the_thinking_budget_only_caps_thinking_requests(client):
    # 66 output tokens leave no room after the 64-token budget for the close sequence
    response = create(client, input="x", max_output_tokens=66, reasoning={"effort": "none"})
    assert response.status in ("completed", "incomplete")


def test_empty_input_probe_is_answered(client):
    response = create(client, input=[], max_output_tokens=1)
    assert response.usage.output_tokens <= 1 and response.status in ("completed", "incomplete")


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": "x", "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ({"input": "x", "background": True}, 400, "unsupported_parameter", "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "unsupported_parameter", "include"),
    ({"input": "x", "top_logprobs": 2}, 400, "unsupported_parameter", "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
    ({"input": "x", "conversation": "conv_1"}, 400, "unsupported_parameter", "conversation"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "invalid_request", "text.format.type"),
    ({"input": "x", "service_tier": "priority"}, 400, "unsupported_parameter", "service_tier"),
    ({"input": "x", "temperature": 3}, 400, "invalid_request", "temperature"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "invalid_request", "metadata.k"),
    ({"input": "x", "reasoning": {"effort": "max"}}, 400, "reasoning_effort_not_supported", "reasoning.effort"),
    ({"input": "x", "max_output_tokens": 66}, 400, "thinking_budget_capacity_insufficient", "max_output_tokens"),
    ({"input": "x", "model": "other"}, 404, "model_not_found", "model"),
    ({"input": "x", "model": None}, 400, "invalid_request", "model"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, 400, "invalid_tool_history",
     "input[0]"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "response_not_found", "previous_response_id"),
])
def test_rejections_name_their_field(server, body, status, code, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (status, code, param), error
    assert r.headers["x-request-id"]


def test_unsupported_resource_operations_fail_explicitly(server, client):
    response = create(client, input="hi", max_output_tokens=1)
    base = f"{server}/v1/responses"
    assert httpx.post(f"{base}/{response.id}/cancel").json()["error"]["code"] == "background_not_supported"
    assert httpx.post(f"{base}/resp_missing/cancel").status_code == 404
    r = httpx.post(f"{base}/compact", json={"model": MODEL, "input": "x"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "compaction_not_supported")
    assert httpx.get(f"{base}/{response.id}", params={"stream": "true"}).json()["error"]["param"] == "stream"
    assert httpx.get(f"{base}/{response.id}", params={"include[]": "x"}).json()["error"]["param"] == "include"
    for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "nope"}):
        r = httpx.get(f"{base}/{response.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(params))


def test_store_lru_and_capacity(small_store):
    client = openai.OpenAI(base_url=f"{small_store}/v1", api_key="unused", max_retries=0)
    a, b, c = (create(client, input=w, max_output_tokens=1) for w in ("a", "b", "c"))
    assert error_of(client.responses.retrieve, a.id)["code"] == "response_not_found"
    assert client.responses.retrieve(b.id).id == b.id and client.responses.retrieve(c.id).id == c.id
    # a summary is kept with its Item but never rendered: big to store, small to run
    huge = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s" * (1 << 20)}],
             "content": [{"type": "reasoning_text", "text": "r"}]}, {"role": "user", "content": "q"}]
    err = error_of(create, client, input=huge)
    assert (err["status"], err["code"], err["param"]) == (400, "response_store_capacity_exceeded", "store")
    assert create(client, input=huge, store=False, max_output_tokens=1).store is False
