"""Schemathesis against a live server's own OpenAPI document: no 5xx, no off-schema answer.

Bodies are generated from the document, valid ones and deliberately broken ones; a
hook caps output lengths so generation stays short on CPU. Status codes, media types
and bodies (JSON, and each event of a stream) must match what the document declares.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
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
MAX_TOKENS = 4
server = server_fixture("--max-context", "256", "--default-max-tokens", str(MAX_TOKENS), "--prefill-chunk", "64",
                        "--max-concurrency", "2", "--api-key", KEY, "--protocols", "openai_chat,openai_completions",
                        "--pending-timeout-ms", "10000", "--log-level", "warning")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: per operation and mode: generation endpoints get most of the time this file takes
EXAMPLES = {"POST": 60, "GET": 15, "HEAD": 3}


def tame(_: Any, body: Any) -> Any:
    """Short outputs and few choices, on the served model (a wrong one is a plain 404)."""
    if isinstance(body, dict):
        body.pop("model", None)
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = max(-1, min(body[name], MAX_TOKENS))
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)
    return body


@pytest.fixture(scope="module")
def api_schema(server):
    loaded = schemathesis.openapi.from_url(f"{server}/schema/openapi.json", headers=AUTH)
    loaded.hook("map_body")(tame)
    return loaded


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors_and_responses_match_the_schema(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/health", "/v1/models", "/v1/chat/completions", "/v1/completions"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # only bodies can be broken: any string is a valid path segment

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES[operation.method.upper()], deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=CHECKS, headers=AUTH, timeout=60)

        try:
            check()
        except BaseException as exc:  # schemathesis reports failures as a BaseExceptionGroup
            exc.add_note(f"operation: {operation.label}")
            raise


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True}, "n": 2, "max_tokens": 3}),
    ("/v1/completions", {"prompt": ["a", "b"], "logprobs": 2, "stream_options": {"include_usage": True},
                         "max_tokens": 3}),
])
def test_streams_match_the_schema_event_by_event(api_schema, path, body):
    case = api_schema[path]["POST"].Case(body={**body, "stream": True})
    response = case.call_and_validate(checks=CHECKS, headers=AUTH, timeout=60)
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert not response.stream_cut_short and response.text.rstrip().endswith("data: [DONE]")
    # The events are really checked: one chunk off its documented shape fails.
    broken = Response(200, response.headers, response.content.replace(b'"index":0', b'"index":"0"', 1),
                      response.request, response.elapsed, response.verify)
    with pytest.raises(FailureGroup, match="SSE event violates schema"):
        case.validate_response(broken, checks=[response_schema_conformance])


def test_missing_credentials_are_documented_401s(api_schema):
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if operation.path in ("/health", "/"):  # open: health checks and reachability probes
            continue
        case = operation.Case(path_parameters={"model_id": "m"} if operation.path_parameters else None,
                              body={"prompt": "x", "messages": []} if operation.body else NOT_SET)
        response = case.call_and_validate(checks=CHECKS, timeout=30)
        assert response.status_code == 401, operation.label


def test_prompt_only_requests_free_their_slot(server):
    # Found by the fuzzer: max_tokens 0 used to leave the request running in the engine,
    # so after --max-concurrency of them every later request timed out.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    for _ in range(3):
        response = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
        assert response.json()["usage"]["completion_tokens"] == 0
    response = httpx.post(f"{server}/v1/chat/completions", json={**body, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
