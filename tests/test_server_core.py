"""The HTTP server core: real ``ninfer-serve`` processes for the wire contract. The app
in-process (engine failure, loading, drain, error mapping) is in test_server_app.py;
keep-alives, disconnects and admission are unit-tested in test_server_streaming.py."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import threading

import httpx
import pytest

from ninfer.server.run import listen_socket
from server_harness import server_fixture, start_server, stop_server

KEY = "test-key-5f2c"
ALIAS = "alias-model"
RID = re.compile(r"^req_[0-9a-f]{32}$")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [A-Z]+ ")

server = server_fixture("--api-key", KEY, "--cors", "--max-request-mib", "1", "--model-id", ALIAS,
                        "--max-context", "512")
# Capacity 1 and a pending deadline no request can meet: every generation is refused,
# either 503 (not admitted in time) or 429 (the slot is taken meanwhile).
busy_server = server_fixture("--max-concurrency", "1", "--max-pending-requests", "0", "--pending-timeout-ms", "1")
AUTH = {"Authorization": f"Bearer {KEY}"}


def _paths(base_url: str, headers: dict[str, str] | None = None) -> dict:
    return httpx.get(f"{base_url}/schema/openapi.json", headers=headers, timeout=30).json()["paths"]


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert RID.match(response.headers["x-request-id"])
    return error


# -- the real server ---------------------------------------------------------------------


def test_health_and_models(server):
    health = httpx.get(f"{server}/health", timeout=10)  # no key needed
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    listing = httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10).json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (ALIAS, "model", 512)
    assert isinstance(card["created"], int) and card["owned_by"]
    assert listing["models"] == [{"name": ALIAS, "model": ALIAS, "type": "model"}]
    assert httpx.get(f"{server}/v1/models/{ALIAS}", headers=AUTH, timeout=10).json() == card
    missing = httpx.get(f"{server}/v1/models/other/model", headers=AUTH, timeout=10)
    assert _error(missing, 404, "model_not_found")["param"] == "model"


def test_request_ids_are_unique_and_on_errors(server):
    responses = [
        httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10),  # 200
        httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10),  # 200
        httpx.get(f"{server}/no/such/path", headers=AUTH, timeout=10),  # 404
        httpx.delete(f"{server}/v1/models", headers=AUTH, timeout=10),  # 405
        httpx.get(f"{server}/v1/models", timeout=10),  # 401
    ]
    assert [r.status_code for r in responses] == [200, 200, 404, 405, 401]
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(RID.match(i) for i in ids) and len(set(ids)) == len(ids)
    _error(responses[2], 404, "not_found")
    _error(responses[3], 405, "method_not_allowed")


def test_api_key_as_bearer_or_x_api_key(server):
    url = f"{server}/v1/models"
    assert _error(httpx.get(url, timeout=10), 401, "invalid_api_key")["type"] == "authentication_error"
    _error(httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10), 401, "invalid_api_key")
    _error(httpx.get(url, headers={"Authorization": KEY}, timeout=10), 401, "invalid_api_key")  # no scheme
    _error(httpx.get(f"{server}/schema/openapi.json", timeout=10), 401, "invalid_api_key")
    assert httpx.get(url, headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(url, headers={"x-api-key": KEY}, timeout=10).status_code == 200
    # The key is checked after routing: an unknown path is a 404 with or without it.
    _error(httpx.get(f"{server}/no/such/path", timeout=10), 404, "not_found")


def test_chat_completions_401_is_openai_shaped(server):
    if "/v1/chat/completions" not in _paths(server, AUTH):
        pytest.skip("no chat completions route installed")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=10,
                         headers={"Authorization": "Bearer wrong"})
    error = _error(refused, 401, "invalid_api_key")
    assert error["type"] == "authentication_error" and refused.headers["www-authenticate"] == "Bearer"
    garbage = httpx.post(f"{server}/v1/chat/completions", content=b"{", timeout=10)
    _error(garbage, 401, "invalid_api_key")  # the key is checked before the body is read


def test_cors_preflight_is_open_and_responses_carry_cors_headers(server):
    preflight = httpx.options(f"{server}/v1/models", timeout=10, headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    simple = httpx.get(f"{server}/v1/models", headers={**AUTH, "Origin": "http://app.example"}, timeout=10)
    assert simple.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in simple.headers["access-control-expose-headers"].lower()
    refused = httpx.get(f"{server}/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_oversized_body_is_413_before_parsing(server):
    posts = sorted(p for p, ops in _paths(server, AUTH).items() if "post" in ops)  # OpenAI-shaped errors first
    if not posts:
        pytest.skip("no installed protocol serves a POST route")
    url = f"{server}{posts[0]}"
    garbage = b"\xff" * (2 << 20)  # 2 MiB that is not JSON: parsing would answer 400
    error = _error(httpx.post(url, content=garbage, headers=AUTH, timeout=30), 413, "request_too_large")
    assert "1 MiB" in error["message"]

    def chunked():  # no Content-Length: the server must count what arrives
        for _ in range(32):
            yield b"\xff" * (64 << 10)

    _error(httpx.post(url, content=chunked(), headers=AUTH, timeout=30), 413, "request_too_large")
    # The same garbage under the limit reaches the parser: a client error, never a 500.
    assert httpx.post(url, content=b"\xff" * 100, headers=AUTH, timeout=30).status_code == 400


def test_openapi_describes_core_and_protocol_routes(server):
    paths = _paths(server, AUTH)
    assert {"/health", "/v1/models", "/v1/models/{model_id}", "/"} <= set(paths)
    assert "503" in paths["/health"]["get"]["responses"]


def test_logs_have_one_format_and_no_secrets(server):
    httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10)
    logs = server.logs()
    assert f"INFO server ready on {server}" in logs
    lines = [line for line in logs.splitlines() if LOG_LINE.match(line)]
    assert len(lines) > 3
    assert KEY not in logs
    assert "HTTP/1.1" not in logs  # no uvicorn access log
    assert "\x1b" not in logs


def test_overload_is_429_and_a_missed_deadline_503(busy_server):
    if "/v1/chat/completions" not in _paths(busy_server):
        pytest.skip("no chat completions route installed")
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{busy_server}/v1/chat/completions", json=body)
                                          for _ in range(8)])

    seen: set[int] = set()
    for _ in range(5):  # a burst normally shows both at once; the arrival order is the network's
        for r in asyncio.run(fire()):
            _error(r, r.status_code, "server_overloaded" if r.status_code == 429 else "request_queue_timeout")
            seen.add(r.status_code)
        if seen == {429, 503}:
            break
    assert seen == {429, 503}
    stream = httpx.post(f"{busy_server}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    _error(stream, 503, "request_queue_timeout")  # before any frame: a real HTTP status
    assert "openai_chat POST /v1/chat/completions 503" in busy_server.logs()


# One generation request per protocol route, and the Retry-After each refusal carries: a
# full server (OpenAI 429, Anthropic 529) frees a slot soonest, a missed admission
# deadline (OpenAI 503, Anthropic 504) means the engine stays busy a little longer.
GENERATIONS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hello", "max_tokens": 4},
    "/v1/responses": {"input": "hello", "max_output_tokens": 16},  # model: the served one, filled in below
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
}
RETRY_AFTER = {429: "1", 529: "1", 503: "2", 504: "2"}


def test_refusals_carry_retry_after_in_every_protocol(busy_server):
    routes = [path for path in GENERATIONS if path in _paths(busy_server)]
    if not routes:
        pytest.skip("no generation route installed")
    (card,) = httpx.get(f"{busy_server}/v1/models", timeout=10).json()["data"]

    async def fire(path: str, body: dict) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{busy_server}{path}", json={**body, "stream": i % 2 == 1})
                                          for i in range(6)])

    for path in routes:
        for r in asyncio.run(fire(path, {"model": card["id"], **GENERATIONS[path]})):
            assert r.status_code in RETRY_AFTER, (path, r.status_code, r.text)
            assert r.headers.get("retry-after") == RETRY_AFTER[r.status_code], (path, r.status_code)
    # The request log names why each one failed.
    logs = busy_server.logs()
    for path in routes:
        assert re.search(rf" POST {path} (429|529|503|504), error (server_overloaded|request_queue_timeout), ",
                         logs), path


def test_sigterm_lets_a_running_stream_finish_then_exits_0():
    url = start_server("--log-stats-interval-ms", "0")
    try:
        if "/v1/chat/completions" in _paths(url):
            chunks: list[str] = []
            first = threading.Event()
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0}

            def consume() -> None:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                                  timeout=120) as response:
                    for line in response.iter_lines():
                        chunks.append(line)
                        first.set()
                first.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert first.wait(120)
            url.process.send_signal(signal.SIGTERM)
            # While draining (if the stream still runs) nothing new is taken; once it
            # ended the listener is gone. Either way no new generation succeeds.
            for method, path, kw in (("POST", "/v1/chat/completions", {"json": body}), ("GET", "/health", {})):
                try:
                    late = httpx.request(method, f"{url}{path}", timeout=30, **kw)
                except httpx.TransportError:
                    continue
                assert late.status_code == 503, late.text
            reader.join(120)
            assert "data: [DONE]" in chunks, chunks[-3:]  # the running stream ran to its end
        else:
            url.process.send_signal(signal.SIGTERM)
        assert url.process.wait(45) == 0
        logs = url.logs()
        assert "shutting down" in logs and "server stopped" in logs
    finally:
        stop_server(url)


# -- listening socket ----------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux socket options")
def test_accepted_connections_inherit_keepalive_and_user_timeout():
    listener = listen_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(listener.getsockname(), timeout=5):
            conn, _ = listener.accept()
            with conn:
                assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15_000
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
    finally:
        listener.close()
