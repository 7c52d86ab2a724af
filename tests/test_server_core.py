"""The HTTP server core: real ``ninfer-serve`` processes for the wire contract, and the
admission, keep-alive and disconnect machinery driven directly at the unit level."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import types

import httpx
import msgspec
import pytest
from litestar import Litestar, Request, get, post
from litestar.params import JSONBody
from loguru import logger

from ninfer.capabilities import Protocol
from ninfer.engine.request import EngineRequest
from ninfer.errors import (
    RequestQueueTimeoutError,
    ServerOverloadedError,
    ServerShuttingDownError,
)
from ninfer.sampling_params import SamplingParams
from ninfer.server.admission import AdmissionGate, Ticket, reset_current_ticket, set_current_ticket
from ninfer.server.app import build_app
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.errors import EXCEPTION_HANDLERS
from ninfer.server.middleware import request_id
from ninfer.server.run import ServerApp, listen_socket
from ninfer.server.sse import KEEPALIVE_FRAME, sse_response
from ninfer.server.state import ServerState
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
    posts = [p for p, ops in _paths(server, AUTH).items() if "post" in ops]
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


def test_sigterm_lets_a_running_stream_finish_then_exits_0():
    url = start_server()
    try:
        if "/v1/chat/completions" in _paths(url):
            chunks: list[str] = []
            first = threading.Event()

            def consume() -> None:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                    for line in response.iter_lines():
                        chunks.append(line)
                        first.set()
                first.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert first.wait(120)
            url.process.send_signal(signal.SIGTERM)
            reader.join(120)
            assert "data: [DONE]" in chunks, chunks[-3:]  # the stream ran to its end
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


# -- raw ASGI driving ------------------------------------------------------------------------


class Client:
    """Calls an ASGI app like a server would, with a disconnect the test can trigger."""

    def __init__(self, app, method: str, path: str, body: bytes = b"", block_sends: bool = False):
        self.messages: list[dict] = []
        self.gone = asyncio.Event()
        self.block_sends = block_sends
        self._body = body
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        self.messages.append(message)
        if self.block_sends and message["type"] == "http.response.body":
            await self.gone.wait()  # a stalled peer, until its connection drops

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def body_parts(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]

    async def wait_for_parts(self, n: int) -> None:
        for _ in range(500):
            if len(self.body_parts) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"only {self.body_parts}")


def _sse_app(make_frames, keepalive_s: float, **kw) -> Litestar:
    @get("/stream", sync_to_thread=False)
    def stream() -> object:
        return sse_response(make_frames(), keepalive_s=keepalive_s, **kw)

    return Litestar([stream], exception_handlers=EXCEPTION_HANDLERS)


def test_sse_keeps_alive_while_idle_and_not_while_busy():
    async def slow():
        await asyncio.sleep(0.25)  # waiting for admission / prefill
        yield "data: 1\n\n"
        await asyncio.sleep(0.25)
        yield b"data: 2\n\n"

    async def fast():
        for i in range(5):
            yield f"data: {i}\n\n"

    async def main():
        client = Client(_sse_app(slow, 0.1), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        assert client.status == 200
        headers = dict(client.messages[0]["headers"])
        assert headers[b"content-type"].startswith(b"text/event-stream")
        assert headers[b"cache-control"] == b"no-cache"
        parts = client.body_parts
        assert parts[0] == KEEPALIVE_FRAME  # the status line went out before any frame
        data = [p for p in parts if p.startswith(b"data")]
        assert data == [b"data: 1\n\n", b"data: 2\n\n"]
        between = parts[parts.index(data[0]) + 1:parts.index(data[1])]
        assert between and set(between) == {KEEPALIVE_FRAME}
        assert parts[-1] == b"" and client.messages[-1]["more_body"] is False

        client = Client(_sse_app(fast, 0.1), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        assert KEEPALIVE_FRAME not in client.body_parts
        assert len(client.body_parts) == 6

    asyncio.run(main())


@pytest.mark.parametrize("how", ["disconnect while waiting", "disconnect while the peer stalls", "server cancels"])
def test_sse_always_closes_the_frames(how):
    closed = asyncio.Event()

    async def frames():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            await asyncio.Event().wait()  # a request that never produces another token
            yield "data: never\n\n"
        finally:
            closed.set()  # where a protocol's engine stream would abort the request

    async def main():
        client = Client(_sse_app(frames, 0.05), "GET", "/stream", block_sends=how == "disconnect while the peer stalls")
        await client.wait_for_parts(1)
        if how == "server cancels":
            client.task.cancel()
        else:
            client.gone.set()
        await asyncio.wait({client.task}, timeout=10)
        assert client.task.done()
        await asyncio.wait_for(closed.wait(), 5)
        assert b"data: never\n\n" not in client.body_parts

    asyncio.run(main())


def test_sse_over_real_tcp_keeps_alive_and_notices_a_closed_connection():
    import uvicorn

    closed = threading.Event()

    async def frames():
        try:
            await asyncio.Event().wait()  # a request queued behind others: no frame for a while
            yield "data: never\n\n"
        finally:
            closed.set()

    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(_sse_app(frames, 0.1), lifespan="off", log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/stream"
        for _ in range(100):
            if server.started:
                break
            threading.Event().wait(0.05)
        with httpx.stream("GET", url, timeout=10) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            received = b""
            for chunk in response.iter_raw():
                received += chunk
                if received.count(KEEPALIVE_FRAME) >= 2:
                    break
        assert set(received.split(b"\n\n")) == {b": keep-alive", b""}
        assert closed.wait(10), "the client hung up but the frames were never closed"
    finally:
        server.should_exit = True
        thread.join(10)


def test_sse_errors_before_the_first_frame_are_http_errors_and_later_ones_frames():
    async def refused():
        raise ServerOverloadedError("full")
        yield  # pragma: no cover - makes this an async generator

    async def late():
        yield "data: 1\n\n"
        raise RequestQueueTimeoutError("too slow")

    async def crashes():
        yield "data: 1\n\n"
        raise RuntimeError("internal detail")

    async def main():
        client = Client(_sse_app(refused, 1.0), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        assert client.status == 429
        assert json.loads(b"".join(client.body_parts))["error"]["code"] == "server_overloaded"

        client = Client(_sse_app(late, 1.0), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        parts = client.body_parts
        assert client.status == 200 and parts[0] == b"data: 1\n\n" and parts[-1] == b""
        assert json.loads(parts[1].removeprefix(b"data: "))["error"]["code"] == "request_queue_timeout"

        client = Client(_sse_app(crashes, 1.0, on_error=lambda e: f"event: error\ndata: {e.code}\n\n"), "GET",
                        "/stream")
        await asyncio.wait_for(client.task, 10)
        assert client.body_parts[1] == b"event: error\ndata: internal_error\n\n"
        assert b"internal detail" not in b"".join(client.body_parts)

    asyncio.run(main())


def test_cancel_on_disconnect_cancels_the_work():
    cleaned = asyncio.Event()

    async def work(forever: bool) -> dict:
        try:
            if forever:
                await asyncio.Event().wait()
            return {"done": True}
        finally:
            cleaned.set()

    @post("/work")
    async def handler(request: Request) -> dict:
        return await cancel_on_disconnect(request, work((await request.json())["forever"]))

    app = Litestar([handler], exception_handlers=EXCEPTION_HANDLERS)

    async def main():
        client = Client(app, "POST", "/work", body=b'{"forever": false}')
        await asyncio.wait_for(client.task, 10)
        assert client.status == 201 and json.loads(client.body_parts[0]) == {"done": True}

        cleaned.clear()
        client = Client(app, "POST", "/work", body=b'{"forever": true}')
        await asyncio.sleep(0.2)
        assert not client.task.done() and not cleaned.is_set()
        client.gone.set()
        await asyncio.wait_for(client.task, 10)
        assert cleaned.is_set()
        assert client.status == 499
        assert json.loads(client.body_parts[0])["error"]["code"] == "request_cancelled"

    asyncio.run(main())


# -- the app in-process: health states, error mapping, protocol routes ------------------------


def _state(*protocols: Protocol, alive: bool = True) -> ServerState:
    server = types.SimpleNamespace(protocols=[p.name for p in protocols], cors=False, api_key=None, max_request_mib=1)
    by_name = {p.name: p for p in protocols}
    registry = types.SimpleNamespace(get=lambda kind, name, key=None: by_name[name])
    return ServerState(profile=types.SimpleNamespace(server=server), registry=registry,
                       engine=types.SimpleNamespace(alive=alive), tokenizer=None, family=None, model_id="m",
                       max_model_len=64, gate=AdmissionGate(1, 1.0))


async def _get(app: Litestar, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, **kw)


def test_health_is_503_after_an_engine_failure_or_while_draining():
    async def main():
        assert (await _get(build_app(_state(alive=False)), "GET", "/health")).status_code == 503
        state = _state()
        app = build_app(state)
        assert (await _get(app, "GET", "/health")).json() == {"status": "ok"}
        state.gate.draining = True
        response = await _get(app, "GET", "/health")
        assert (response.status_code, response.json()) == (503, {"status": "unavailable"})

    asyncio.run(main())


class Counted(msgspec.Struct):
    n: int


def test_protocol_routes_are_tagged_and_failures_never_leak():
    @post("/v1/boom")
    async def boom(data: JSONBody[Counted]) -> dict:
        raise RuntimeError("kaboom")

    @post("/v1/strict")
    async def strict(request: Request) -> dict:
        return {"n": msgspec.json.decode(await request.body(), type=Counted).n, "id": request_id(request)}

    records: list[str] = []
    # As ninfer.log configures the served sink: no variable values, no frames above the catch.
    sink = logger.add(records.append, level="DEBUG", format="{level} {message}", diagnose=False, backtrace=False)
    secret = {"n": 1, "secret": "prompt-" + "text"}
    try:
        app = build_app(_state(Protocol("boom", routes=lambda state: [boom, strict])))

        async def main():
            crashed = await _get(app, "POST", "/v1/boom", json=secret)
            error = _error(crashed, 500, "internal_error")
            assert error["type"] == "server_error" and "kaboom" not in error["message"]
            for bad in ({"n": "x"}, {}):  # Litestar's validation names the field
                assert _error(await _get(app, "POST", "/v1/boom", json=bad), 400, "invalid_request")["param"] == "n"
            for bad in (b'{"n": "x"}', b"{}"):  # so does a protocol's own msgspec decoding
                assert _error(await _get(app, "POST", "/v1/strict", content=bad), 400, "invalid_request")["param"] == "n"
            assert (await _get(app, "POST", "/v1/strict", content=b"{")).status_code == 400
            ok = await _get(app, "POST", "/v1/strict", content=b'{"n": 2}')
            assert ok.json() == {"n": 2, "id": ok.headers["x-request-id"]}  # handlers see the header's id

        asyncio.run(main())
    finally:
        logger.remove(sink)
    text = "".join(records)
    assert "unhandled RuntimeError" in text and "prompt-text" not in text
    assert re.search(r"INFO req_[0-9a-f]{32} boom POST /v1/boom 500, [0-9.]+ s", text), text


# -- startup placeholder and draining ------------------------------------------------------------


def test_while_loading_health_is_503_and_other_paths_model_loading():
    app = ServerApp(profile=None, registry=None, url="http://127.0.0.1:1")

    async def main():
        health = Client(app, "GET", "/health")
        other = Client(app, "POST", "/v1/chat/completions", body=b"{}")
        await asyncio.wait_for(asyncio.gather(health.task, other.task), 10)
        assert health.status == 503 and json.loads(health.body_parts[0]) == {"status": "unavailable"}
        assert other.status == 503
        assert json.loads(other.body_parts[0])["error"]["code"] == "model_loading"
        for client in (health, other):
            assert RID.match(dict(client.messages[0]["headers"])[b"x-request-id"].decode())

    asyncio.run(main())


def test_drain_waits_for_requests_in_flight_then_exits():
    gate = AdmissionGate(capacity=2, pending_timeout_s=1.0)
    app = ServerApp(profile=None, registry=None, url="http://127.0.0.1:1")
    app.server = types.SimpleNamespace(should_exit=False)
    app.state = types.SimpleNamespace(gate=gate)
    ticket = gate.reserve(Ticket())

    async def main():
        app.loop = asyncio.get_running_loop()
        app.on_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert gate.draining and not app.server.should_exit
        with pytest.raises(ServerShuttingDownError):
            gate.reserve(Ticket())
        ticket.release()
        for _ in range(50):
            if app.server.should_exit:
                break
            await asyncio.sleep(0.05)
        assert app.server.should_exit

    asyncio.run(main())


# -- admission over the real engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    return LLM(str(tiny_qwen3), dtype="fp32", device="cpu", max_concurrency=1, prefill_chunk=64, block_size=4,
               max_context=2048, kv_capacity=4096)


def _request(llm, rid: str, max_tokens: int) -> EngineRequest:
    ids = llm.get_tokenizer().encode("Admission control in front of the engine")
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def _run_with_engine(llm, body) -> None:
    from ninfer.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine, stats_interval_s=0)
    engine.start()
    try:
        asyncio.run(body(engine))
    finally:
        engine.shutdown()


async def _until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_gate_refuses_when_full_and_frees_the_slot_on_close(llm):
    gate = AdmissionGate(capacity=1, pending_timeout_s=30)

    async def body(engine):
        running = gate.generate(engine, _request(llm, "long", 1500))
        admitted = await anext(running)
        assert admitted.token_ids == [] and admitted.timings.admitted is not None
        assert gate.in_flight == 1
        with pytest.raises(ServerOverloadedError):
            await anext(gate.generate(engine, _request(llm, "refused", 4)))
        await running.aclose()  # a client leaving: the slot comes back, the engine aborts
        assert gate.in_flight == 0
        await _until(lambda: not llm.engine.has_unfinished())
        events = [e async for e in gate.generate(engine, _request(llm, "after", 3))]
        assert events[-1].finished and events[-1].num_output_tokens == 3

    _run_with_engine(llm, body)


def test_gate_times_out_unadmitted_requests_and_aborts_them(llm):
    gate = AdmissionGate(capacity=4, pending_timeout_s=0.3)

    async def body(engine):
        running = gate.generate(engine, _request(llm, "holder", 1500))  # takes the engine's one lane
        await anext(running)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RequestQueueTimeoutError):
            await anext(gate.generate(engine, _request(llm, "queued", 4)))
        assert 0.25 <= loop.time() - started < 5
        assert gate.in_flight == 1
        await _until(lambda: llm.engine.scheduler.num_waiting == 0)  # the queued request was aborted
        await running.aclose()
        await _until(lambda: not llm.engine.has_unfinished())

    _run_with_engine(llm, body)


def test_an_http_request_keeps_its_slot_until_released_and_counts_tokens(llm):
    gate = AdmissionGate(capacity=1, pending_timeout_s=30)

    async def body(engine):
        ticket = Ticket()
        token = set_current_ticket(ticket)
        try:
            gate.reserve()  # a protocol claiming capacity before preparation
            assert ticket.holds_slot and gate.in_flight == 1
            events = [e async for e in gate.generate(engine, _request(llm, "counted", 3))]
        finally:
            reset_current_ticket(token)
        assert gate.in_flight == 1  # the response is not sent yet
        assert (ticket.prompt_tokens, ticket.completion_tokens) == (events[-1].num_prompt_tokens, 3)
        ticket.release()
        assert gate.in_flight == 0
        gate.draining = True
        with pytest.raises(ServerShuttingDownError):
            await anext(gate.generate(engine, _request(llm, "late", 3)))

    _run_with_engine(llm, body)
