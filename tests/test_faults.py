"""Faults injected into the real components of an in-process server: who fails, and how.

A fault inside one request's tokenizer call, tool parser or guide fails that request
alone with a typed error (a 500 ``internal_error``, or the stream's error event), while
a request beside it is answered. A fault in the model forward or the sampler fails the
requests of that step (they share one batch): one running alone fails alone and the
request queued behind it is answered. A fault that breaks the engine turns /health to
503 and ends every request in flight with an error instead of leaving it hanging.
Nothing leaks: no slot, engine request or KV page stays taken.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from _served import call, served_state

from ninfer.engine.guided_state import GuidedState
from ninfer.frontend.tool_regions import TaggedToolParser
from ninfer.server.app import build_app

SEED = 4242  # marks the victim's engine rows for the step-level faults
ASK = [{"role": "user", "content": "hi"}]
BOOM = "zebra quartz boom"
TOOLS = [{"type": "function", "function": {"name": "boom", "parameters": {"type": "object"}}}]


def _served(tiny_qwen3, *flags):
    state = served_state(tiny_qwen3, "--max-context", "1024", "--log-stats-interval-ms", "0", *flags)
    return state, build_app(state)


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    state, app = _served(tiny_qwen3, "--max-concurrency", "2")
    yield state, app
    state.engine.shutdown()


@pytest.fixture()
def fresh(tiny_qwen3):
    """A server whose engine a test may break (max concurrency 1: a second request queues)."""
    state, app = _served(tiny_qwen3, "--max-concurrency", "1")
    yield state, app
    state.engine.shutdown()


def _chat(content: str = "hi", stream: bool = False, **extra) -> dict:
    # a forced ordinary token keeps every answer non-empty (the tool parser sees text)
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "logit_bias": {"300": 100},
            "stream": stream, "chat_template_kwargs": {"enable_thinking": False}, **extra}


def _stream_error(response) -> dict:
    """The error event ending a stream (status 200: the stream had started)."""
    assert response.status_code == 200, response.text
    last = [line for line in response.text.splitlines() if line.startswith("data: ")][-1]
    assert last != "data: [DONE]", response.text
    return json.loads(last[6:])["error"]


async def _settled(state, within: float = 10.0) -> None:
    """Every slot, engine request and KV page given back."""
    engine = state.engine.engine
    deadline = time.monotonic() + within
    while state.gate.in_flight or engine.has_unfinished() or engine.block_manager.num_used_blocks:
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: {state.gate.in_flight} slots, unfinished "
                                 f"{engine.has_unfinished()}, {engine.block_manager.num_used_blocks} KV pages")
        await asyncio.sleep(0.05)


def _tokenizer_fault(monkeypatch, state):
    encode = state.tokenizer.encode

    def faulty(text, *args, **kwargs):
        if BOOM in text:
            raise RuntimeError("injected tokenizer fault")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(state.tokenizer, "encode", faulty)
    return _chat(BOOM)


def _tool_parser_fault(monkeypatch, state):
    feed = TaggedToolParser.feed

    def faulty(self, text):
        if "boom" in self.tools:
            raise RuntimeError("injected tool parser fault")
        return feed(self, text)

    monkeypatch.setattr(TaggedToolParser, "feed", faulty)
    return _chat(tools=TOOLS)


def _guide_fault(monkeypatch, state):
    def faulty(self, token_id):  # only guided requests have a guide
        raise RuntimeError("injected guide fault")

    monkeypatch.setattr(GuidedState, "on_token", faulty)
    return _chat(response_format={"type": "json_object"})


@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "stream"])
@pytest.mark.parametrize("inject", [_tokenizer_fault, _tool_parser_fault, _guide_fault],
                         ids=["tokenizer", "tool_parser", "guide"])
def test_a_fault_in_one_requests_component_fails_that_request_alone(served, monkeypatch, inject, stream):
    state, app = served
    victim = {**inject(monkeypatch, state), "stream": stream}

    async def main():
        failed, bystander = await asyncio.gather(call(app, "POST", "/v1/chat/completions", json=victim),
                                                 call(app, "POST", "/v1/chat/completions", json=_chat()))
        assert bystander.status_code == 200 and bystander.json()["usage"]["completion_tokens"] > 0
        if stream and inject is not _tokenizer_fault:  # a preparation failure is still a plain HTTP error
            error = _stream_error(failed)
        else:
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
        assert (error["code"], error["type"]) == ("internal_error", "server_error")
        assert "injected" not in error["message"]  # the details go to the log only
        assert (await call(app, "GET", "/health")).status_code == 200
        await _settled(state)

    asyncio.run(main())


def _step_fault(monkeypatch, state, where: str, once: bool = True) -> list[int]:
    """Fail the model forward (or the sampler) of a step holding the victim's rows (seed
    ``SEED``): the first such step, or every one when not ``once``. Returns [faults raised]."""
    runner = state.engine.engine.runner
    raised, victim_in_step = [0], [False]
    launch = runner.launch

    def marking_launch(sched, *args, **kwargs):
        victim_in_step[0] = any(c.seq.sampling.seed == SEED for c in sched.chunks)
        return launch(sched, *args, **kwargs)

    def fault(real):
        def faulty(*args, **kwargs):
            if victim_in_step[0] and (not once or raised[0] == 0):
                raised[0] += 1
                raise RuntimeError(f"injected {where} fault")
            return real(*args, **kwargs)
        return faulty

    monkeypatch.setattr(runner, "launch", marking_launch)
    if where == "forward":
        monkeypatch.setattr(runner.model, "forward", fault(runner.model.forward))
    else:
        monkeypatch.setattr(runner, "sampler", fault(runner.sampler))
    return raised


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_step_fails_its_requests_and_the_engine_carries_on(fresh, monkeypatch, where):
    state, app = fresh
    raised = _step_fault(monkeypatch, state, where)

    async def main():
        victim = asyncio.ensure_future(call(app, "POST", "/v1/chat/completions", json=_chat(seed=SEED, stream=True)))
        await asyncio.sleep(0.2)  # the victim runs; the bystander waits for the only slot
        bystander = await call(app, "POST", "/v1/chat/completions", json=_chat())
        error = _stream_error(await victim)
        assert error["code"] == "internal_error" and raised[0] == 1
        assert bystander.status_code == 200 and bystander.json()["usage"]["completion_tokens"] > 0
        assert state.engine.alive and (await call(app, "GET", "/health")).status_code == 200
        await _settled(state)

    asyncio.run(main())


def test_a_broken_engine_fails_every_request_in_flight_and_health(fresh, monkeypatch):
    state, app = fresh
    _step_fault(monkeypatch, state, "forward", once=False)

    async def main():
        streams = [call(app, "POST", "/v1/chat/completions", json=_chat(seed=SEED, stream=True)) for _ in range(3)]
        aggregates = [call(app, "POST", "/v1/chat/completions", json=_chat(seed=SEED)) for _ in range(3)]
        answers = await asyncio.wait_for(asyncio.gather(*streams, *aggregates), 60)
        for response in answers[:3]:
            assert _stream_error(response)["code"] in ("internal_error", "engine_unavailable")
        for response in answers[3:]:
            assert response.status_code in (500, 503), response.text
        assert not state.engine.alive
        health = await call(app, "GET", "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "30"
        late = await call(app, "POST", "/v1/chat/completions", json=_chat())
        assert (late.status_code, late.json()["error"]["code"]) == (503, "engine_unavailable")
        assert state.gate.in_flight == 0

    asyncio.run(main())


def test_an_engine_thread_that_dies_ends_its_streams_instead_of_hanging(fresh, monkeypatch):
    state, app = fresh
    scheduler = state.engine.engine.scheduler
    schedule = scheduler.schedule
    broken = [False]

    def faulty(*args, **kwargs):  # a bug outside the step's own failure handling
        if broken[0]:
            raise RuntimeError("injected scheduler fault")
        return schedule(*args, **kwargs)

    monkeypatch.setattr(scheduler, "schedule", faulty)

    async def main():
        running = [asyncio.ensure_future(call(app, "POST", "/v1/chat/completions",
                                              json={**_chat(stream=True), "max_tokens": 500})),
                   asyncio.ensure_future(call(app, "POST", "/v1/chat/completions",
                                              json={**_chat(), "max_tokens": 500}))]
        await asyncio.sleep(0.3)
        broken[0] = True
        stream, aggregate = await asyncio.wait_for(asyncio.gather(*running), 30)
        assert _stream_error(stream)["code"] == "engine_unavailable"
        assert (aggregate.status_code, aggregate.json()["error"]["code"]) == (503, "engine_unavailable")
        assert (await call(app, "GET", "/health")).status_code == 503
        assert state.gate.in_flight == 0

    asyncio.run(main())
