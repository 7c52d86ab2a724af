"""Runs the engine on its own thread and streams events to asyncio callers.

The HTTP layer never waits on the device: it submits requests and aborts through a
queue, and the engine thread hands each step's events back to the event loop in one
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from ninfer.engine.llm_engine import LLMEngine
from ninfer.engine.request import EngineRequest, GenerationEvent
from ninfer.engine.stats import ContextCacheCounters, IntervalStats
from ninfer.errors import EngineDeadError


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_interval_s: float = 5.0):
        self.engine = engine
        self.stats_interval_s = stats_interval_s
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
        await accepted
        finished = False
        try:
            while not finished:
                event: GenerationEvent = await events.get()
                finished = event.finished
                yield event
        finally:
            if not finished:  # client went away or the consumer stopped early
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            if self.engine.abort_request(request_id) is not None:
                logger.debug("request {} aborted", request_id)
            self._streams.pop(request_id, None)

        self._inbox.put(do_abort)

    # -- the engine thread -------------------------------------------------------
    def _loop(self) -> None:
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
            job()
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self, events: list[GenerationEvent]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]] = {}
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.finished:
                del self._streams[event.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self) -> None:
        self._publish(self.engine.fail_all(EngineDeadError(self.engine.dead or "engine failed")))

    def _log_stats(self) -> None:
        s = self.engine.stats.take_interval()
        cache = ContextCacheCounters.of(self.engine.scheduler)
        before, self._last_cache = self._last_cache, cache
        if s.steps == 0 and self.engine.scheduler.num_waiting == 0:
            return  # fully idle intervals are omitted
        logger.info(throughput_line(s, self.engine.scheduler, self.engine.block_manager.usage(), before, cache))
        summary = cache.summary()
        if summary != self._last_cache_summary:  # only when the cache did something
            self._last_cache_summary = summary
            logger.info(summary)


def throughput_line(s: IntervalStats, scheduler, kv_usage: float, before: ContextCacheCounters,
                    now: ContextCacheCounters) -> str:
    """The periodic line: rates and the decode batch over the interval, gauges at its end.

    ``prefix hit`` is the share of prompt tokens found cached by the lookups made during
    the interval (between the counters ``before`` and ``now``); it is left out when the
    interval made none. With speculative decoding it adds the tokens each verify round
    committed on average and, per draft position, the share of rounds that kept it.
    """
    line = (f"throughput: prefill {s.prefill_tps:.1f} tok/s, decode {s.decode_tps:.1f} tok/s, "
            f"running {scheduler.num_running}, waiting {scheduler.num_waiting}, "
            f"avg batch {s.avg_decode_batch:.1f}, KV {kv_usage:.0%} used")
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
