"""Counters behind the periodic throughput line and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class IntervalStats:
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    steps: int
    decode_rows: int
    busy_seconds: float
    finished: int

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def avg_decode_batch(self) -> float:
        return self.decode_rows / self.steps if self.steps else 0.0


@dataclass
class EngineStats:
    """Accumulates since the last :meth:`take_interval`; totals never reset."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    decode_rows: int = 0
    busy_seconds: float = 0.0
    finished: int = 0
    total_prefill_tokens: int = 0
    total_decode_tokens: int = 0
    total_cached_tokens: int = 0
    total_prompt_tokens: int = 0
    _since: float = field(default_factory=time.monotonic)

    def record_step(self, sched, seconds: float) -> None:
        decode = sched.num_decode
        prefill = sched.num_batched_tokens - decode
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.total_prefill_tokens += prefill
        self.total_decode_tokens += decode
        self.steps += 1
        self.decode_rows += decode
        self.busy_seconds += seconds

    def record_finish(self, seq) -> None:
        self.finished += 1
        self.total_cached_tokens += seq.num_cached_tokens
        self.total_prompt_tokens += seq.num_prompt_tokens

    def take_interval(self) -> IntervalStats:
        now = time.monotonic()
        out = IntervalStats(
            seconds=now - self._since,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            steps=self.steps,
            decode_rows=self.decode_rows,
            busy_seconds=self.busy_seconds,
            finished=self.finished,
        )
        self.prefill_tokens = self.decode_tokens = self.steps = self.decode_rows = self.finished = 0
        self.busy_seconds = 0.0
        self._since = now
        return out

    @property
    def prefix_hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0
