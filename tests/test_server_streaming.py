"""Streaming and admission machinery at the unit level: the SSE response (keep-alives,
late headers, cleanup), cancel-on-disconnect, and the admission gate over the real engine."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from litestar import Litestar, Request, get, post

from ninfer.engine.request import EngineRequest
from ninfer.errors import RequestQueueTimeoutError, ServerOverloadedError, ServerShuttingDownError
from ninfer.sampling_params import SamplingParams
from ninfer.server.admission import AdmissionGate, Ticket, reset_current_ticket, set_current_ticket
from ninfer.server.disconnect import cancel_on_disconnect
from ninfer.server.errors import EXCEPTION_HANDLERS
from ninfer.server.run import listen_socket
from ninfer.server.sse import KEEPALIVE_FRAME, sse_response


# -- SSE responses and disconnects, over raw ASGI ----------------------------------------------


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


def test_sse_frames_escape_the_line_breaks_splitlines_sees():
    """U+2028, U+2029 and U+0085 inside a JSON string: valid raw, but readers that split
    with str.splitlines (httpx's iter_lines) would cut the event in two."""
    text = "one\u2028two\u2029three\x85four"

    async def frames():
        yield "data: " + json.dumps({"text": text}, ensure_ascii=False) + "\n\n"

    async def main():
        client = Client(_sse_app(frames, 5.0), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        body = b"".join(client.body_parts).decode()
        lines = [line for line in body.splitlines() if line]
        assert len(lines) == 1 and json.loads(lines[0][6:]) == {"text": text}

    asyncio.run(main())


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


def test_sse_protocol_idle_frame_only_after_the_first_frame():
    """A protocol's own idle frame (Anthropic's ping event) may not precede its opening
    event: while the request waits the transport comment keeps the connection alive."""
    ping = b"event: ping\ndata: {}\n\n"

    async def queued():
        await asyncio.sleep(0.25)  # waiting for admission
        yield "event: message_start\ndata: {}\n\n"
        await asyncio.sleep(0.25)  # prefill
        yield "event: message_stop\ndata: {}\n\n"

    async def main():
        client = Client(_sse_app(queued, 0.1, keepalive_frame=ping), "GET", "/stream")
        await asyncio.wait_for(client.task, 10)
        parts = [p for p in client.body_parts if p]
        opening = parts.index(b"event: message_start\ndata: {}\n\n")
        assert opening > 0 and set(parts[:opening]) == {KEEPALIVE_FRAME}
        assert set(parts[opening + 1:-1]) == {ping}

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
