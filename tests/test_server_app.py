"""The server app in-process (no server process): states a live process rarely shows
(engine failure, loading, drain), error mapping and protocol routes. The wire contract
of real ``ninfer-serve`` processes is in test_server_core.py."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import types

import httpx
import msgspec
import pytest
from litestar import Request, Response, get, post
from litestar.params import JSONBody
from loguru import logger

from ninfer.capabilities import Protocol
from ninfer.errors import EngineDeadError, NinferError, ServerOverloadedError, ServerShuttingDownError
from ninfer.server.admission import AdmissionGate, Ticket
from ninfer.server.app import build_app
from ninfer.server.middleware import request_id
from ninfer.server.run import ServerApp
from ninfer.server.sse import sse_response
from ninfer.server.state import ServerState
from _served import served_state
from test_server_core import KEY, RID, _error


# -- the app in-process: health states, error mapping, protocol routes ------------------------


def _state(*protocols: Protocol, alive: bool = True, api_key: str | None = None) -> ServerState:
    server = types.SimpleNamespace(protocols=[p.name for p in protocols], cors=False, api_key=api_key,
                                   max_request_mib=1)
    by_name = {p.name: p for p in protocols}
    registry = types.SimpleNamespace(get=lambda kind, name, key=None: by_name[name])
    return ServerState(profile=types.SimpleNamespace(server=server), registry=registry,
                       engine=types.SimpleNamespace(alive=alive), tokenizer=None, family=None, model_id="m",
                       max_model_len=64, vocab_size=128, gate=AdmissionGate(1, 1.0))


async def _get(app, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, **kw)


def test_health_is_503_after_an_engine_failure_or_while_draining():
    async def main():
        failed = await _get(build_app(_state(alive=False)), "GET", "/health")
        assert (failed.status_code, failed.headers["retry-after"]) == (503, "30")  # only a restart helps
        state = _state()
        app = build_app(state)
        ok = await _get(app, "GET", "/health")
        assert ok.json() == {"status": "ok"} and "retry-after" not in ok.headers
        state.gate.draining = True
        response = await _get(app, "GET", "/health")
        assert (response.status_code, response.json()) == (503, {"status": "unavailable"})
        assert response.headers["retry-after"] == "5"

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
                invalid = await _get(app, "POST", "/v1/boom", json=bad)
                assert _error(invalid, 400, "invalid_request")["param"] == "n"
            for raw in (b'{"n": "x"}', b"{}"):  # so does a protocol's own msgspec decoding
                invalid = await _get(app, "POST", "/v1/strict", content=raw)
                assert _error(invalid, 400, "invalid_request")["param"] == "n"
            assert (await _get(app, "POST", "/v1/strict", content=b"{")).status_code == 400
            ok = await _get(app, "POST", "/v1/strict", content=b'{"n": 2}')
            assert ok.json() == {"n": 2, "id": ok.headers["x-request-id"]}  # handlers see the header's id

        asyncio.run(main())
    finally:
        logger.remove(sink)
    text = "".join(records)
    assert "unhandled RuntimeError" in text and "prompt-text" not in text
    assert re.search(r"INFO req_[0-9a-f]{32} boom POST /v1/boom 500, error internal_error, [0-9.]+ s", text), text
    assert re.search(r"boom POST /v1/strict 400, error invalid_request, ", text), text
    assert re.search(r"boom POST /v1/strict 201, [0-9.]+ s", text), text  # no error, no code


def test_a_missing_key_is_answered_in_the_routes_own_error_shape():
    def own_shape(_: Request, exc: NinferError) -> Response:  # a protocol with an error shape of its own
        return Response({"own": type(exc).__name__}, status_code=401)

    @get("/v1/own", exception_handlers={NinferError: own_shape}, sync_to_thread=False)
    def own() -> dict:
        return {}

    records: list[str] = []
    sink = logger.add(records.append, level="DEBUG", format="{level} {message}")
    try:
        app = build_app(_state(Protocol("own", routes=lambda state: [own]), api_key=KEY))

        async def main():
            refused = await _get(app, "GET", "/v1/own")
            assert (refused.status_code, refused.json()) == (401, {"own": "AuthenticationError"})
            assert RID.match(refused.headers["x-request-id"])
            assert (await _get(app, "GET", "/v1/own", headers={"x-api-key": KEY})).status_code == 200
            core = await _get(app, "GET", "/v1/models")
            assert _error(core, 401, "invalid_api_key")["type"] == "authentication_error"
            assert core.headers["www-authenticate"] == "Bearer"
            # Only the probes and CORS preflights are open (test_server_auth.py checks every route).
            for method, path in (("GET", "/health"), ("HEAD", "/")):
                assert (await _get(app, method, path)).status_code == 200, (method, path)
            preflight = {"origin": "https://example.com", "access-control-request-method": "GET"}
            assert (await _get(app, "OPTIONS", "/v1/own", headers=preflight)).status_code == 204
            for method, path in (("OPTIONS", "/v1/own"), ("GET", "/")):
                assert (await _get(app, method, path)).status_code == 401, (method, path)

        asyncio.run(main())
    finally:
        logger.remove(sink)
    assert re.search(r"INFO req_[0-9a-f]{32} own GET /v1/own 401, error invalid_api_key, [0-9.]+ s",
                     "".join(records))


def test_retry_after_whatever_renders_the_refusal_and_late_stream_errors_are_logged():
    def own_shape(_: Request, exc: NinferError) -> Response:  # Anthropic-like: overload is a 529
        return Response({"own": exc.code}, status_code=529 if exc.status == 429 else exc.status)

    @get("/v1/full", exception_handlers={NinferError: own_shape}, sync_to_thread=False)
    def full() -> dict:
        raise ServerOverloadedError("full")

    @get("/v1/late")
    async def late() -> Response:
        async def frames():
            yield "data: 1\n\n"
            raise EngineDeadError("gone")

        return sse_response(frames())

    records: list[str] = []
    sink = logger.add(records.append, level="DEBUG", format="{level} {message}")
    try:
        app = build_app(_state(Protocol("own", routes=lambda state: [full, late])))

        async def main():
            refused = await _get(app, "GET", "/v1/full")
            assert (refused.status_code, refused.json()) == (529, {"own": "server_overloaded"})
            assert refused.headers["retry-after"] == "1"
            streamed = await _get(app, "GET", "/v1/late")  # the error arrives as a last frame
            assert streamed.status_code == 200 and "engine_unavailable" in streamed.text
            assert "retry-after" not in streamed.headers

        asyncio.run(main())
    finally:
        logger.remove(sink)
    text = "".join(records)
    assert re.search(r"own GET /v1/full 529, error server_overloaded, [0-9.]+ s", text), text
    assert re.search(r"own GET /v1/late 200, error engine_unavailable, [0-9.]+ s", text), text


# -- startup placeholder and draining ------------------------------------------------------------


def test_while_loading_health_is_503_and_other_paths_model_loading():
    app = ServerApp(profile=None, registry=None, url="http://127.0.0.1:1")  # no engine yet

    async def main():
        health = await _get(app, "GET", "/health")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        assert RID.match(health.headers["x-request-id"]) and health.headers["retry-after"] == "5"
        loading = await _get(app, "POST", "/v1/chat/completions", json={})
        _error(loading, 503, "model_loading")
        assert loading.headers["retry-after"] == "5"

    asyncio.run(main())


async def _exits(app: ServerApp, within: float) -> bool:
    for _ in range(int(within / 0.05)):
        if app.server.should_exit:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("finishes", [True, False])
def test_drain_waits_for_requests_in_flight_then_exits(monkeypatch, finishes):
    monkeypatch.setattr("ninfer.server.drain.CUT_GRACE_S", 0.5)
    gate = AdmissionGate(capacity=2, pending_timeout_s=1.0)
    app = ServerApp(profile=None, registry=None, url="http://127.0.0.1:1")
    app.drain_timeout_s = 1.0
    app.server = types.SimpleNamespace(should_exit=False, server_state=types.SimpleNamespace(connections=set()))
    failed: list[NinferError] = []  # what the engine was told to end its requests with
    app.state = types.SimpleNamespace(gate=gate, engine=types.SimpleNamespace(fail_requests=failed.append))
    ticket = gate.reserve(Ticket())

    async def main():
        app.loop = asyncio.get_running_loop()
        app.on_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert gate.draining and not app.server.should_exit
        with pytest.raises(ServerShuttingDownError):
            gate.reserve(Ticket())
        if finishes:
            ticket.release()
            assert await _exits(app, 0.5)
            assert not failed and not gate.cut
        else:  # past the bound: the engine ends what runs, then the server exits
            assert await _exits(app, 3.0) and gate.in_flight == 1
            assert gate.cut and [e.code for e in failed] == ["server_shutting_down"]

    asyncio.run(main())


# -- a signal while the model loads ----------------------------------------------------------------


def test_a_signal_while_loading_waits_for_the_load_and_shuts_down_what_it_built(monkeypatch):
    """Unit level (no hook slows a real load): returning from lifespan shutdown while the loader
    thread is still in torch made the interpreter abort (exit 134); it must join the loader and
    stop the engine the load then hands over."""
    release, shut = threading.Event(), []
    built = types.SimpleNamespace(engine=types.SimpleNamespace(shutdown=lambda: shut.append(True)))

    def slow_build(profile, registry, stopping=lambda: False):
        release.wait(5)
        return built  # as if the model finished loading after the signal

    monkeypatch.setattr("ninfer.server.run.build_state", slow_build)
    monkeypatch.setattr("ninfer.server.run.build_app", lambda state: object())
    app = ServerApp(profile=None, registry=None, url="http://127.0.0.1:1")
    app.server = types.SimpleNamespace(should_exit=False, server_state=types.SimpleNamespace(connections=set()))
    records: list[str] = []
    sink = logger.add(lambda m: records.append(m), format="{message}")

    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        sent: list[str] = []

        async def send(message):
            sent.append(message["type"])

        await inbox.put({"type": "lifespan.startup"})
        lifespan = asyncio.create_task(app._lifespan(inbox.get, send))
        while "lifespan.startup.complete" not in sent:
            await asyncio.sleep(0.01)
        app.on_signal(signal.SIGTERM)
        await asyncio.sleep(0.05)
        assert app.server.should_exit and app.loading
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.sleep(0.2)
        assert not lifespan.done()  # still waiting for the loader
        release.set()
        await asyncio.wait_for(lifespan, 5)
        assert sent[-1] == "lifespan.shutdown.complete" and not app.loading

    try:
        asyncio.run(main())
    finally:
        logger.remove(sink)
    assert shut == [True] and app.state is None and not app.failed
    text = "".join(records)
    assert "shutting down while the model loads" in text
    assert "server stopped; the model load was interrupted" in text


def test_build_state_stops_between_steps_when_asked(monkeypatch):
    monkeypatch.setattr("ninfer.server.run.build_engine", lambda profile, registry: types.SimpleNamespace())
    from ninfer.server.run import build_state

    assert build_state(None, None, stopping=lambda: True) is None


def test_a_kv_pool_below_the_context_bounds_max_model_len_and_is_logged_once_loaded(tiny_qwen3):
    """/v1/models advertises what a request can reach: the pool (100 tokens, 112 in 16-token
    pages) caps it below --max-context; the loaded id and pool size are logged."""
    records: list[str] = []
    sink = logger.add(lambda m: records.append(m), format="{message}")
    try:
        state = served_state(tiny_qwen3, "--kv-capacity", "100", "--max-context", "4096")
    finally:
        logger.remove(sink)
    try:
        assert (state.kv_capacity_tokens, state.max_model_len) == (112, 112)
        models = asyncio.run(_get(build_app(state), "GET", "/v1/models")).json()
        assert models["data"][0]["max_model_len"] == 112
    finally:
        state.engine.shutdown()
    assert f"serving {state.model_id} (max_model_len 112), KV pool 112 tokens\n" in "".join(records)
