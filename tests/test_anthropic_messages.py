"""POST /v1/messages and /v1/messages/count_tokens against a real ``ninfer-serve``, through
the official ``anthropic`` SDK where it can express the request, raw httpx where not.

One module-scoped server on the tiny model (API key on; one active plus one waiting
request, so overload and queue timeouts can be provoked). Outputs are kept to a few
tokens: decoding on a busy CPU is slow. Block assembly for reasoning and tool markup
the random model rarely writes is in tests/test_anthropic_messages_render.py.
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import pytest
from server_harness import server_fixture

KEY = "local-secret"
MAX_CONTEXT = 1024
PENDING_TIMEOUT_S = 1.0
#: only reachable by max_tokens above it, which these tests avoid except on purpose
DEFAULT_BUDGET = 2000
server = server_fixture("--max-context", str(MAX_CONTEXT), "--prefill-chunk", "256", "--api-key", KEY,
                        "--protocols", "anthropic_messages", "--max-concurrency", "1", "--max-pending-requests", "1",
                        "--pending-timeout-ms", str(int(PENDING_TIMEOUT_S * 1000)),
                        "--default-thinking-budget", str(DEFAULT_BUDGET))
MODEL = "claude-local"
USER = [{"role": "user", "content": "Name three rivers."}]
TOOL = {"name": "get_weather", "description": "weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


#: greedy, so the same request gives the same text (this SDK version has no temperature argument)
GREEDY = {"temperature": 0}


def create(client, **kw):
    return client.messages.create(**{"model": MODEL, "messages": USER, "max_tokens": 6, "extra_body": GREEDY, **kw})


def post(server, body: dict, path: str = "/v1/messages", **kw) -> httpx.Response:
    return httpx.post(f"{server}{path}", json={"model": MODEL, **body}, headers={"x-api-key": KEY}, timeout=60, **kw)


def test_create_and_stream_agree(client):
    system = "You are terse."  # a prompt of its own, so the first request cannot hit the cache
    agg = create(client, system=system)
    with client.messages.stream(model=MODEL, messages=USER, max_tokens=6, extra_body=GREEDY, system=system) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in agg.content]
    assert (final.stop_reason, final.usage.output_tokens) == (agg.stop_reason, agg.usage.output_tokens)
    assert agg.model == MODEL and agg.id.startswith("msg_") and agg.type == "message" and agg.role == "assistant"
    # the same prompt again reuses the first one's pages; the split changes, the total does not
    assert agg.usage.cache_read_input_tokens == 0 and final.usage.cache_read_input_tokens >= 16
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == agg.usage.input_tokens
    assert agg.usage.cache_creation_input_tokens is None  # not measured
    if agg.stop_reason == "max_tokens":
        assert agg.usage.output_tokens == 6


def test_count_tokens_equals_the_run(client):
    messages = [{"role": "user", "content": "Count me, a prompt seen only here."}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="Be exact.",
                                           thinking={"type": "disabled"}, tools=[TOOL])
    ran = create(client, messages=messages, system="Be exact.", thinking={"type": "disabled"}, tools=[TOOL],
                 max_tokens=1)
    assert ran.usage.input_tokens == counted.input_tokens and ran.usage.cache_read_input_tokens == 0
    again = create(client, messages=messages, system="Be exact.", thinking={"type": "disabled"}, tools=[TOOL],
                   max_tokens=1)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    # thinking mode and tools change the prompt, so they change the count
    assert client.messages.count_tokens(model=MODEL, messages=messages, system="Be exact.").input_tokens \
        < counted.input_tokens


def test_billing_nonce_does_not_defeat_prefix_reuse(client):
    def system(nonce: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197; cch={nonce};"},
                {"type": "text", "text": "You are a coding agent. " * 8, "cache_control": {"type": "ephemeral"}}]

    messages = [{"role": "user", "content": [{"type": "text", "text": "List the files.",
                                              "cache_control": {"type": "ephemeral"}}]}]
    first = create(client, system=system("a1b2c"), messages=messages, max_tokens=1)
    second = create(client, system=system("f9e8d"), messages=messages, max_tokens=1)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.cache_read_input_tokens >= total - 16  # all but the last, partial KV page
    without = client.messages.count_tokens(model=MODEL, system=system("x")[1:], messages=messages).input_tokens
    assert without == total


def test_prefill_is_continued(client, server):
    history = [{"role": "user", "content": "Finish the sentence."}, {"role": "assistant", "content": "The sky is"}]
    counted = client.messages.count_tokens(model=MODEL, messages=history).input_tokens
    reopened = client.messages.count_tokens(model=MODEL, messages=[*history, {"role": "user", "content": ""}])
    assert counted < reopened.input_tokens  # the assistant turn stays open: no end marker, no new turn
    ran = create(client, messages=history, max_tokens=3)
    assert ran.usage.input_tokens == counted
    with_thinking = post(server, {"messages": history, "max_tokens": 2000,
                                  "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert with_thinking.status_code == 400 and "prefill" in with_thinking.json()["error"]["message"]


def test_adaptive_thinking_takes_the_server_budget(server):
    # max_tokens just past the server's budget leaves no room for the tokens that close thinking
    body = {"messages": USER, "max_tokens": DEFAULT_BUDGET + 10}
    for thinking in ({"type": "adaptive"}, None):
        r = post(server, {**body, "thinking": thinking} if thinking else body)
        assert r.status_code == 400 and "thinking budget" in r.json()["error"]["message"]
    # a request's own budget replaces it (and its validity is checked against max_tokens)
    r = post(server, {**body, "thinking": {"type": "enabled", "budget_tokens": DEFAULT_BUDGET + 10}})
    assert r.status_code == 400 and "less than max_tokens" in r.json()["error"]["message"]


def test_stop_reasons_and_stop_sequence(client):
    free = create(client, max_tokens=10)
    text = "".join(b.text for b in free.content if b.type == "text")
    assert free.stop_reason in ("max_tokens", "end_turn")
    assert (free.stop_reason == "max_tokens") == (free.usage.output_tokens == 10)
    stop = text[3:5]
    if len(text) < 5 or not stop.strip() or "\ufffd" in text[:5]:
        pytest.skip("the greedy output has no usable stop string")
    stopped = create(client, max_tokens=10, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert "".join(b.text for b in stopped.content) == text[: text.index(stop)]


def test_context_window_exhaustion(client, server):
    def count(words: int) -> int:
        return client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "river " * words}],
                                            thinking={"type": "disabled"}).input_tokens

    per_word = (count(100) - count(50)) / 50
    words = int(100 + (MAX_CONTEXT - 4 - count(100)) / per_word)
    while count(words) > MAX_CONTEXT - 2:
        words -= 1
    prompt = count(words)
    assert MAX_CONTEXT - prompt >= 2
    # without max_tokens the server default (8192) exceeds the room left: the context ends the output
    r = post(server, {"messages": [{"role": "user", "content": "river " * words}], "temperature": 0,
                      "thinking": {"type": "disabled"}})
    message = r.json()
    assert r.status_code == 200 and message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] \
        == prompt
    if message["stop_reason"] != "end_turn":  # the model may end on its own first
        assert message["stop_reason"] == "model_context_window_exceeded"
        assert message["usage"]["output_tokens"] == MAX_CONTEXT - prompt


def test_tools_and_tool_history(client):
    history = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "from-another-server"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "25C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "unknown city", "is_error": True}]},
    ]
    ran = create(client, messages=history, tools=[{**TOOL, "input_examples": [{"city": "Oslo"}]}])
    assert ran.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert create(client, messages=history, tools=[TOOL], tool_choice={"type": "none"}).usage.input_tokens \
        < ran.usage.input_tokens + ran.usage.cache_read_input_tokens  # tool_choice none renders no tools
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=history, tools=[TOOL], tool_choice={"type": "tool", "name": "get_time"})
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "tool_choice" in body["error"]["message"] and body["request_id"].startswith("req_")


def test_raw_sse_framing(server):
    with httpx.stream("POST", f"{server}/v1/messages?beta=true", json={
            "model": MODEL, "messages": USER, "max_tokens": 4, "stream": True, "temperature": 0},
            headers={"x-api-key": KEY}, timeout=60) as r:
        body = r.read().decode()
    assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in body.split("\n\n") if f]
    names = []
    for f in frames:
        event, data = f.split("\n")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name  # every frame is named for its payload
        names.append(name)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = json.loads(frames[0].split("\n")[1][6:])["message"]
    end = json.loads(frames[-2].split("\n")[1][6:])
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] \
        == end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
    assert end["usage"]["output_tokens"] >= 1 and end["delta"]["stop_reason"]


def test_errors_auth_and_probes(server, client):
    r = post(server, {"messages": USER, "max_tokens": 0})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"] and r.headers["request-id"] == body["request_id"]
    for bad in (b"{not json", b'{"model": "m", "messages": "x", "max_tokens": "8"}'):
        r = httpx.post(f"{server}/v1/messages", content=bad, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error" and r.headers["request-id"]
    assert post(server, {"messages": USER}, path="/v1/messages/count_tokens?beta=true").status_code == 200
    assert post(server, {"messages": USER, "max_tokens": 1}, path="/v1/messages?beta=true").status_code == 200
    assert post(server, {"model": "", "messages": USER}).status_code == 400
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=USER)
    # Claude Code's first probe (HEAD / answers without a key too)
    assert httpx.head(f"{server}/", headers={"x-api-key": KEY}, timeout=10).status_code == 200


def test_a_tool_name_anthropic_refuses_is_a_400_on_its_name(client):
    for choice in ({"type": "auto"}, {"type": "any"}):  # not only where a grammar forces a call
        with pytest.raises(anthropic.BadRequestError) as info:
            create(client, tools=[{**TOOL, "name": "get weather"}], tool_choice=choice)
        assert info.value.body["error"]["message"].startswith("tools[0].name: ")


@pytest.mark.parametrize("method, path, status, kind", [
    ("GET", "/v1/messages", 405, "invalid_request_error"),
    ("GET", "/v1/messages/count_tokens", 405, "invalid_request_error"),
    ("POST", "/v1/messages/batches", 404, "not_found_error"),
])
def test_routing_errors_under_messages_are_anthropic_shaped(server, method, path, status, kind):
    r = httpx.request(method, f"{server}{path}", json={}, headers={"x-api-key": KEY}, timeout=10)
    body = r.json()
    assert r.status_code == status and body["type"] == "error" and body["error"]["type"] == kind
    assert r.headers["request-id"] == body["request_id"] == r.headers["x-request-id"]
    other = httpx.get(f"{server}/v1/messagesx", headers={"x-api-key": KEY}, timeout=10)
    assert other.status_code == 404 and "code" in other.json()["error"]  # not under /v1/messages: the core's shape


def test_a_missing_key_is_an_anthropic_shaped_401(server):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=USER, max_tokens=1)
    response = refused.value.response
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error" and body["error"]["message"]
    assert response.headers["request-id"] == body["request_id"] == response.headers["x-request-id"]
    assert refused.value.request_id == body["request_id"]  # where the SDK reports it from
    keyless = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 1},
                         timeout=10)
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"


def test_overload_is_529_and_queue_timeout_504(server):
    """One request runs; of two more, one waits (and times out) and one finds no slot."""
    hog = httpx.stream("POST", f"{server}/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 960,
        "temperature": 0, "stream": True, "thinking": {"type": "disabled"}})
    answers: list[httpx.Response] = []

    def send() -> None:
        answers.append(post(server, {"messages": USER, "max_tokens": 1}))

    with hog as running:
        lines = running.iter_lines()  # kept: a discarded line iterator closes the connection
        assert next(lines) == "event: message_start"  # admitted: it holds the only engine slot
        started = time.monotonic()
        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert sorted(r.status_code for r in answers) == [504, 529]
    overloaded, timed_out = sorted(answers, key=lambda r: -r.status_code)
    assert overloaded.json()["error"]["type"] == "overloaded_error"
    assert timed_out.json()["error"]["type"] == "timeout_error"
    assert all(r.headers["request-id"] == r.json()["request_id"] for r in answers)
    assert time.monotonic() - started >= PENDING_TIMEOUT_S - 0.2
