"""``--request-log-jsonl`` on a real server: every protocol's traffic, every line checked.

One server (speculating with ngram, a thinking budget, an API key) gets chat (aggregate
and streamed), Responses, Anthropic and legacy completions requests, a forced tool
call, a request refused in preparation, one refused without the key, and a stream the
client drops. Then every line must validate against the schema kept in the repo,
every started request must have exactly one terminal (a refusal none and no start),
and no prompt, output, tool argument or key may appear in the file.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_harness import running_server

from ninfer.server.request_log import SCHEMA, SCHEMA_PATH

KEY = "k3y-never-logged-5551"
HEADERS = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny:qwen3"
BUDGET = 3
#: words that appear in prompts and nowhere else: the log must not contain them
MARKERS = ("quokka", "zanzibar", "marmalade", "xylophone", "kumquat", "obsidian", "plankton")
REPEATING = "quokka two three four quokka two three four quokka two three four quokka two"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]


def _post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=HEADERS, timeout=120, **kw)


def _chat(url: str, content: str, **kw) -> dict:
    response = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                                   **kw})
    assert response.status_code == 200, response.text
    return response.json()


def _drop_stream(url: str) -> None:
    """Read a few events of a long stream, then hang up."""
    body = {"messages": [{"role": "user", "content": "obsidian story"}], "max_tokens": 400, "stream": True,
            "logit_bias": {"300": 100}, **NO_THINKING}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _terminals_written(path: Path) -> bool:
    events = Counter(r["event"] for r in _lines(path))
    return events["request_start"] == events["request_done"] + events["request_error"]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """Run the traffic; returns (log lines, texts the server generated, the tool calls' arguments)."""
    log = tmp_path_factory.mktemp("request-log") / "campaign.jsonl"
    flags = ("--request-log-jsonl", str(log), "--api-key", KEY, "--spec", "ngram", "--draft-tokens", "3",
             "--max-context", "512", "--max-concurrency", "2", "--default-thinking-budget", str(BUDGET),
             "--log-stats-interval-ms", "200")
    outputs, arguments = [], []
    with running_server(*flags) as url:
        spec = _chat(url, REPEATING, max_tokens=24, temperature=0, ignore_eos=True, **NO_THINKING)
        outputs.append(spec["choices"][0]["message"]["content"])
        streamed = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "zanzibar"}],  # thinks
                                                       "max_tokens": 70, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
        tools = _chat(url, "kumquat weather", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      max_tokens=64, seed=7, **NO_THINKING)
        arguments += [c["function"]["arguments"] for c in tools["choices"][0]["message"]["tool_calls"]]
        responses = _post(url, "/v1/responses", {"model": MODEL, "input": "marmalade", "max_output_tokens": 16,
                                                 "reasoning": {"effort": "none"}})
        assert responses.status_code == 200, responses.text
        anthropic = _post(url, "/v1/messages", {"model": MODEL, "max_tokens": 16, "thinking": {"type": "disabled"},
                                                "messages": [{"role": "user", "content": "xylophone"}]})
        assert anthropic.status_code == 200, anthropic.text
        outputs += [b["text"] for b in anthropic.json()["content"] if b["type"] == "text"]
        legacy = _post(url, "/v1/completions", {"model": MODEL, "prompt": "plankton", "max_tokens": 12})
        assert legacy.status_code == 200, legacy.text
        outputs.append(legacy.json()["choices"][0]["text"])
        too_long = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "quokka " * 600}]})
        assert too_long.status_code == 400, too_long.text
        unauthorised = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
        assert unauthorised.status_code == 401  # refused by the key guard: not a measurement request
        _drop_stream(url)
        deadline = time.monotonic() + 30  # the dropped stream's terminal comes once its handler unwound
        while not _terminals_written(log) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a throughput interval after the traffic
    return _lines(log), log.read_text(), {"spec": spec, "tools": tools, "outputs": outputs, "arguments": arguments}


def test_every_line_validates_against_the_schema_in_the_repo(traffic):
    lines, _, _ = traffic
    schema = json.loads(SCHEMA_PATH.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for line in lines:
        errors = [e.message for e in validator.iter_errors(line)]
        assert not errors, (line["event"], errors[:3])
    assert lines[0]["event"] == "server_start" and {r["schema"] for r in lines} == {SCHEMA}
    assert len({r["server_instance_id"] for r in lines}) == 1
    events = Counter(r["event"] for r in lines)
    assert events["request_start"] == 7 and events["request_rejected"] == 1 and events["throughput"] >= 1


def test_each_started_request_ends_exactly_once_and_a_refusal_never_starts(traffic):
    lines, _, _ = traffic
    starts = {r["request_seq"]: r for r in lines if r["event"] == "request_start"}
    terminals = Counter(r["request_seq"] for r in lines if r["event"] in ("request_done", "request_error"))
    assert terminals == Counter(list(starts)), "each start has one terminal, and no terminal lacks a start"
    (rejected,) = [r for r in lines if r["event"] == "request_rejected"]
    assert rejected["request_seq"] not in starts and rejected["phase"] == "prepare"
    assert rejected["error"]["status"] == 400 and rejected["shape"]["messages"] == 1
    assert rejected["resolved_reasoning_effort"] is None
    seqs = [r["request_seq"] for r in lines if r["event"] in ("request_start", "request_rejected")]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # monotonic within the instance
    protocols = {r["protocol"] for r in starts.values()}
    assert protocols == {"openai_chat", "openai_completions", "openai_responses", "anthropic_messages"}
    (cancelled,) = [r for r in lines if r["event"] == "request_error"]
    assert cancelled["kind"] == "cancelled" and cancelled["result"]["completion_tokens"] > 0


def test_outcomes_carry_usage_speculation_tools_and_the_thinking_budget(traffic):
    lines, _, seen = traffic
    done = [r for r in lines if r["event"] == "request_done"]
    spec = next(r for r in done if r["result"]["completion_tokens"] == 24)
    usage = seen["spec"]["usage"]
    assert (spec["result"]["prompt_tokens"], spec["result"]["completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    s = spec["timings_seconds"]["speculative"]
    assert s["backend"] == "ngram" and s["draft_window"] == 3 and s["drafted_tokens"] > 0
    assert s["drafted_tokens"] == seen["spec"]["timings"]["draft_n"]
    assert s["accepted_tokens"] == seen["spec"]["timings"]["draft_n_accepted"] == sum(s["accepted_per_position"])
    t = spec["timings_seconds"]
    assert 0 < t["ttft"] <= t["total"] and t["prefill"] <= t["ttft"] and t["vision"] is None
    engine = spec["engine_timing"]
    assert engine["units"]["steps"] == engine["units"]["prefill_steps"] + engine["units"]["decode_steps"]
    tools = next(r for r in done if r["result"]["tool_call_parse"]["calls"])
    assert tools["result"]["tool_call_parse"] == {"marker_seen": True, "calls": 1, "omitted_empty_args": 0,
                                                  "mismatched_args": 0, "fallback_reason": "none"}
    budgets = [r["thinking_budget"] for r in done if r["thinking_budget"] is not None]
    assert budgets and all(b["budget"] == BUDGET and b["counted_tokens"] <= BUDGET for b in budgets)
    assert all(r["choices"][0]["sampler"]["seed"] is not None for r in done)
    throughput = [r for r in lines if r["event"] == "throughput"]
    assert sum(r["tokens"]["decode"] for r in throughput) > 0
    assert any(r["speculative"] and r["speculative"]["drafted_tokens"] for r in throughput)


def test_no_prompt_output_argument_or_key_reaches_the_file(traffic):
    lines, text, seen = traffic
    for word in MARKERS:
        assert word not in text, word
    for output in seen["outputs"] + seen["arguments"]:
        if len(output) >= 12:  # shorter noise could match a field name by chance
            assert output not in text
    assert KEY not in text
    argv = lines[0]["argv"]
    assert argv[argv.index("--api-key") + 1] == "<redacted>"
    assert lines[0]["profile"]["server"]["api_key"] == "<redacted>"
