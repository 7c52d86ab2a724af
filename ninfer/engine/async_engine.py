"""Runs the engine on its own thread and streams events to asyncio callers.

The HTTP layer never waits on the device: it submits requests and aborts through a
queue, and the engine thread hands each step's events back to the event loop in one
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from ninfer.engine.llm_engine import LLMEngine
from ninfer.engine.request import EngineRequest, GenerationEvent, RequestTimings
from ninfer.engine.stats import ContextCacheCounters, IntervalStats
from ninfer.errors import EngineDeadError, NinferError


#: how often a request waiting for the engine thread to take it checks that the thread lives
WATCH_S = 1.0
#: receives an interval's stats and the prefix cache's counters at its start and end
IntervalHook = Callable[[IntervalStats, ContextCacheCounters, ContextCacheCounters], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_interval_s: float = 5.0,
                 on_interval: Optional[IntervalHook] = None):
        self.engine = engine
        self.stats_interval_s = stats_interval_s
        #: called on the engine thread with each non-idle interval, next to the throughput
        #: line (the request log's throughput event); it reads the engine's gauges itself
        self.on_interval = on_interval
        self._last_cache_summary = ""
        #: the prefix cache's cumulative counters at the last throughput line, for per-interval rates
        self._last_cache = ContextCacheCounters.of(engine.scheduler)
        self._inbox: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)  # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.engine.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # -- requests ----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationEvent]:
        """Validate, queue and stream one request; closing the iterator aborts it.

        Validation errors are raised before the first event, so callers can answer
        with a plain HTTP error.
        """
        if not self.alive:
            raise EngineDeadError(self.engine.dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        rid = request.request_id

        def add() -> None:
            try:
                self.engine.add_request(request)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, accepted, exc)
                return
            self._streams[rid] = (loop, events)
            loop.call_soon_threadsafe(_settle, accepted, None)

        self._inbox.put(add)
        try:
            while not accepted.done():  # an engine thread that died never settles it
                await asyncio.wait({accepted}, timeout=WATCH_S)
                if not accepted.done() and not self.alive:
                    raise EngineDeadError(self.engine.dead or "the engine is not running")
        except BaseException:  # cancelled (a queue timeout, a hang-up) before the engine took it
            self.abort(rid)  # queued behind the add, so the request never runs unread
            raise
        accepted.result()
        finished = False
        try:
            while not finished:
                event: GenerationEvent = await events.get()
                finished = event.finished
                yield event
        finally:
            if not finished:  # client went away or the consumer stopped early
                self.abort(rid)

    def fail_requests(self, error: NinferError) -> None:
        """End every request the engine holds with ``error`` (thread-safe; the drain's cut)."""
        self._inbox.put(lambda: self._publish(self.engine.fail_all(error)))

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            if self.engine.abort_request(request_id) is not None:
                logger.debug("request {} aborted", request_id)
            self._streams.pop(request_id, None)

        self._inbox.put(do_abort)

    # -- the engine thread -------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a bug outside a step's own handling: no request may hang on it
            self.engine.dead = self.engine.dead or f"the engine thread failed: {type(exc).__name__}"
            logger.opt(exception=exc).error("engine stopped: {}", self.engine.dead)
            self._fail_streams(EngineDeadError(self.engine.dead))

    def _fail_streams(self, error: EngineDeadError) -> None:
        """A last event carrying ``error`` for every stream, without the engine's bookkeeping
        (which may be what broke)."""
        for rid, (loop, events) in list(self._streams.items()):
            event = GenerationEvent(rid, [], "", 0, 0, 0, RequestTimings(arrival=time.monotonic()), finished=True,
                                    finish_reason="error", error=error)
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_deliver, [(events, event)])
        self._streams.clear()

    def _run(self) -> None:
        next_stats = time.monotonic() + self.stats_interval_s
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._publish(self.engine.step())
                if self.engine.dead:
                    logger.error("engine stopped: {}", self.engine.dead)
                    self._fail_all()
                    return
            if self.stats_interval_s > 0 and time.monotonic() >= next_stats:
                self._log_stats()
                next_stats = time.monotonic() + self.stats_interval_s

    def _drain_inbox(self, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=min(self.stats_interval_s or 1.0, 1.0)) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            started = time.perf_counter()
            job()
            self.engine.stats.record_control("requests", time.perf_counter() - started)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self, events: list[GenerationEvent]) -> None:
        started = time.perf_counter()
        self._hand_over(events)
        self.engine.stats.record_control("publish", time.perf_counter() - started)

    def _hand_over(self, events: list[GenerationEvent]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]] = {}
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.finished:
                del self._streams[event.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop has closed: nobody reads these requests any more
                for _, event in items:
                    self.engine.abort_request(event.request_id)
                    self._streams.pop(event.request_id, None)

    def _fail_all(self) -> None:
        self._publish(self.engine.fail_all(EngineDeadError(self.engine.dead or "engine failed")))

    def _log_stats(self) -> None:
        s = self.engine.stats.take_interval()
        cache = ContextCacheCounters.of(self.engine.scheduler)
        before, self._last_cache = self._last_cache, cache
        if s.steps == 0 and self.engine.scheduler.num_waiting == 0:
            return  # fully idle intervals are omitted
        logger.info(throughput_line(s, self.engine.scheduler, self.engine.block_manager.usage(), before, cache))
        if self.on_interval is not None:
            try:
                self.on_interval(s, before, cache)
            except Exception:  # a measurement sink must never stop the engine
                logger.opt(exception=True).warning("the throughput record could not be written")
        summary = cache.summary()
        if summary != self._last_cache_summary:  # only when the cache did something
            self._last_cache_summary = summary
            logger.info(summary)


def throughput_line(s: IntervalStats, scheduler, kv_usage: float, before: ContextCacheCounters,
                    now: ContextCacheCounters) -> str:
    """The periodic line: token counts and rates, the decode batch and the engine thread's
    Host-active time over the interval; the scheduler's gauges at its end.

    Zero counts (an interval that only prefilled, an empty queue) are left out rather than
    printed as zeros; the running count is always split into prefilling and decode-ready.
    ``prefix hit`` is the share of prompt tokens found cached by the lookups made during
    the interval (between the counters ``before`` and ``now``); it is left out when the
    interval made none. With speculative decoding it adds the tokens each verify round
    committed on average and, per draft position, the share of rounds that kept it.
    """
    parts = [f"{name} {tokens} tokens ({tokens / s.seconds if s.seconds > 0 else 0.0:.1f} tok/s)"
             for name, tokens in (("prefill", s.prefill_tokens), ("decode", s.decode_tokens)) if tokens]
    if s.finished:
        parts.append(f"finished {s.finished}")
    running, prefilling = scheduler.num_running, scheduler.num_prefilling
    parts.append(f"running {running} ({prefilling} prefilling, {running - prefilling} decode-ready)")
    if scheduler.num_waiting:
        parts.append(f"waiting {scheduler.num_waiting}")
    if s.decode_steps:
        parts.append(f"avg batch {s.avg_decode_batch:.1f}")
    host = s.host_work.host_total
    share = f" ({host / s.seconds:.0%} of {s.seconds:.1f} s)" if s.seconds > 0 else ""
    parts.append(f"host active {host:.2f} s{share}")
    parts.append(f"KV {kv_usage:.0%} used")
    line = "throughput: " + ", ".join(parts)
    looked_up = now.lookup_tokens - before.lookup_tokens
    if looked_up > 0:
        line += f", prefix hit {(now.hit_tokens - before.hit_tokens) / looked_up:.0%}"
    if s.rounds:
        per_position = " ".join(f"{a:.2f}" for a in s.position_acceptance)
        line += f", spec: {s.acceptance_length:.2f} tokens/round, acceptance by position {per_position}"
    return line


def _settle(future: asyncio.Future, exc: Optional[BaseException]) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _deliver(items: list[tuple[asyncio.Queue, GenerationEvent]]) -> None:
    for q, event in items:
        q.put_nowait(event)
