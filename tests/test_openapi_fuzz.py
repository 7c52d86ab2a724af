"""Schemathesis against a live server's own OpenAPI document: no 5xx, no off-schema answer.

Every operation of every protocol (Chat, Completions, Responses and its store, Anthropic
Messages, tokenize) is fuzzed with bodies and query strings generated from the document,
valid ones and deliberately broken ones. Status codes, media types and bodies (JSON, and
each event of a stream) must match what the document declares. Hooks (tests/_fuzz.py)
keep generations short, hand real stored Response ids to the ``{response_id}`` routes and
count the cases. ``NINFER_FUZZ_SCALE`` multiplies the examples per operation:
scripts/openapi_fuzz runs this module at a larger scale and prints the tally.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest
import schemathesis
from _fuzz import MAX_TOKENS, StoredIds, Tally, tame
from hypothesis import HealthCheck, given, settings
from schemathesis import Response
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import server_fixture

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "fuzz-model"
server = server_fixture("--max-context", "256", "--default-max-tokens", str(MAX_TOKENS), "--prefill-chunk", "64",
                        "--max-concurrency", "2", "--api-key", KEY, "--model-id", MODEL,
                        "--pending-timeout-ms", "10000", "--log-level", "warning", "--log-stats-interval-ms", "0")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
SCALE = float(os.environ.get("NINFER_FUZZ_SCALE", "1"))
#: examples per operation and mode: generations get the most; the document's own routes few
EXAMPLES = {"POST": 20, "GET": 10, "DELETE": 10, "HEAD": 2}
TALLY = Tally()


@pytest.fixture(scope="module")
def api_schema(server):
    loaded = schemathesis.openapi.from_url(f"{server}/schema/openapi.json", headers=AUTH)
    loaded.hook("map_body")(tame(MODEL))
    stored = StoredIds(server, AUTH, MODEL)

    # Plain functions: schemathesis marks its hooks with an attribute, which methods cannot take.
    def map_path_parameters(ctx: Any, params: Any) -> Any:
        return stored.map_path_parameters(ctx, params)

    def after_call(ctx: Any, case: Any, response: Any) -> None:
        stored.after_call(ctx, case, response)
        TALLY.after_call(ctx, case, response)

    loaded.hook("map_path_parameters")(map_path_parameters)
    loaded.hook("after_call")(after_call)
    return loaded


def _fuzzable(operation: Any, mode: GenerationMode) -> bool:
    """Only bodies and query strings can be broken: any string is a valid path segment."""
    if mode is GenerationMode.POSITIVE:
        return True
    return bool(operation.body) or bool(operation.query)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors_and_responses_match_the_schema(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert paths >= {"/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
                     "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items", "/v1/messages",
                     "/v1/messages/count_tokens", "/tokenize", "/detokenize"}
    started, before = time.monotonic(), sum(TALLY.cases.values())
    for operation in operations:
        if not _fuzzable(operation, mode):
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=max(1, round(EXAMPLES[operation.method.upper()] * SCALE)), deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=CHECKS, headers=AUTH, timeout=60)

        try:
            check()
        except BaseException as exc:  # schemathesis reports failures as a BaseExceptionGroup
            exc.add_note(f"operation: {operation.label}")
            raise
    print(f"\n{mode.value}: {sum(TALLY.cases.values()) - before} cases in {time.monotonic() - started:.0f} s\n"
          f"{TALLY.report()}")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True}, "n": 2, "max_tokens": 3}),
    ("/v1/completions", {"prompt": ["a", "b"], "logprobs": 2, "stream_options": {"include_usage": True},
                         "max_tokens": 3}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3,
                       "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
])
def test_streams_match_the_schema_event_by_event(api_schema, path, body):
    case = api_schema[path]["POST"].Case(body={**body, "stream": True})
    response = case.call_and_validate(checks=CHECKS, headers=AUTH, timeout=60)
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert not response.stream_cut_short
    # The events are really checked: one event off its documented shape fails.
    key = b'"sequence_number":' if path == "/v1/responses" else b'"index":'
    assert key in response.content
    broken = Response(200, response.headers, response.content.replace(key + b"0", key + b'"0"', 1),
                      response.request, response.elapsed, response.verify)
    with pytest.raises(FailureGroup, match="SSE event"):
        case.validate_response(broken, checks=[response_schema_conformance])


def test_missing_credentials_are_documented_401s(api_schema):
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in (("GET", "/health"), ("HEAD", "/")):
            continue  # open: health checks and reachability probes
        params = {name: "m" for name in ("model_id", "response_id") if "{" + name + "}" in operation.path}
        case = operation.Case(path_parameters=params or None,
                              body={"prompt": "x", "messages": []} if operation.body else NOT_SET)
        response = case.call_and_validate(checks=CHECKS, timeout=30)
        assert response.status_code == 401, operation.label


def test_the_store_routes_answer_their_documented_shapes(api_schema, server):
    created = httpx.post(f"{server}/v1/responses", headers=AUTH, timeout=60,
                         json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    rid = created.json()["id"]
    for method, path, query, status in [
        ("GET", "/v1/responses/{response_id}", {}, 200),
        ("GET", "/v1/responses/{response_id}", {"stream": "true"}, 400),
        ("GET", "/v1/responses/{response_id}/input_items", {"limit": 1, "order": "asc"}, 200),
        ("GET", "/v1/responses/{response_id}/input_items", {"after": "nope"}, 400),
        ("POST", "/v1/responses/{response_id}/cancel", {}, 400),
        ("POST", "/v1/responses/compact", {}, 400),
        ("DELETE", "/v1/responses/{response_id}", {}, 200),
        ("DELETE", "/v1/responses/{response_id}", {}, 404),
        ("GET", "/v1/responses/{response_id}", {}, 404),
        ("POST", "/v1/responses/{response_id}/cancel", {}, 404),
    ]:
        params = {"response_id": rid} if "{" in path else None
        case = api_schema[path][method].Case(path_parameters=params, query=query or None)
        response = case.call_and_validate(checks=CHECKS, headers=AUTH, timeout=30)
        assert response.status_code == status, (method, path, query, response.text)


def test_prompt_only_requests_free_their_slot(server):
    # Found by the fuzzer: max_tokens 0 used to leave the request running in the engine,
    # so after --max-concurrency of them every later request timed out.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    for _ in range(3):
        response = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
        assert response.json()["usage"]["completion_tokens"] == 0
    response = httpx.post(f"{server}/v1/chat/completions", json={**body, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
