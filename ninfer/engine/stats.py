"""Counters behind the periodic throughput line and the benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ninfer.engine.exposure import HostWork, StepPhases
from ninfer.engine.context_cache import CheckpointStats
from ninfer.engine.state_cache import SnapshotStats


@dataclass
class IntervalStats:
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    steps: int
    #: steps that decoded at least one sequence (mixed prefill + decode steps count)
    decode_steps: int
    decode_rows: int
    busy_seconds: float
    finished: int
    #: speculative rounds: how many, drafts proposed, drafts accepted, and per draft
    #: position (0 = first) how often a round reached it and kept it
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    #: the engine thread's time over the interval (ninfer.engine.exposure)
    host_work: HostWork = field(default_factory=HostWork)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify round: accepted drafts plus the target's own."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position, the share of rounds that reached it and kept its draft."""
        return [k / r if r else 0.0 for k, r in zip(self.kept, self.reached)]

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def avg_decode_batch(self) -> float:
        """Sequences per decode step; prefill-only steps would dilute it (0.5 at concurrency 1)."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


@dataclass
class EngineStats:
    """Accumulates since the last :meth:`take_interval`; totals never reset."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    busy_seconds: float = 0.0
    finished: int = 0
    total_prefill_tokens: int = 0
    total_decode_tokens: int = 0
    total_cached_tokens: int = 0
    total_prompt_tokens: int = 0
    #: decode steps launched before the previous step's tokens reached the host
    total_steps_ahead: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    #: whole-run speculative totals (the interval counters above reset)
    total_rounds: int = 0
    total_drafted: int = 0
    total_accepted: int = 0
    #: per draft position, rounds that kept it, over the whole run (Prometheus counters)
    total_kept: list = field(default_factory=list)
    _reached: list = field(default_factory=list)
    _kept: list = field(default_factory=list)
    _host_work: HostWork = field(default_factory=HostWork)
    _since: float = field(default_factory=time.monotonic)

    def record_step(self, sched, seconds: float) -> None:
        decode = sched.num_decode
        # a verify row's drafts are not prefill; its kept drafts count in record_round
        prefill = sched.num_batched_tokens - sum(c.num_tokens for c in sched.chunks[:decode])
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.total_prefill_tokens += prefill
        self.total_decode_tokens += decode
        self.steps += 1
        self.decode_steps += decode > 0
        self.decode_rows += decode
        self.busy_seconds += seconds

    def record_round(self, drafted: int, accepted: int) -> None:
        """One verify row: ``drafted`` proposals, the first ``accepted`` of them kept."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.total_rounds += 1
        self.total_drafted += drafted
        self.total_accepted += accepted
        self.decode_tokens += accepted  # the target's own token is the row's decode token
        self.total_decode_tokens += accepted
        grow = drafted - len(self._reached)
        if grow > 0:
            self._reached += [0] * grow
            self._kept += [0] * grow
        grow = drafted - len(self.total_kept)
        if grow > 0:
            self.total_kept += [0] * grow
        for i in range(drafted):
            self._reached[i] += 1
            self._kept[i] += i < accepted
            self.total_kept[i] += i < accepted

    def record_phases(self, step: StepPhases) -> None:
        """A finished step's wall-time segments (the engine thread's own)."""
        self._host_work.add_step(step)

    def host_work_so_far(self) -> HostWork:
        """A copy of the current interval's engine-thread segments (a benchmark diffs two)."""
        return self._host_work.copy()

    def record_control(self, phase: str, seconds: float) -> None:
        """Engine-thread work outside steps: adding/aborting requests, publishing events."""
        self._host_work.add_control(phase, seconds)

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
            decode_steps=self.decode_steps,
            decode_rows=self.decode_rows,
            busy_seconds=self.busy_seconds,
            finished=self.finished,
            rounds=self.rounds,
            drafted=self.drafted,
            accepted=self.accepted,
            reached=tuple(self._reached),
            kept=tuple(self._kept),
            host_work=self._host_work,
        )
        self.prefill_tokens = self.decode_tokens = self.steps = self.decode_steps = self.decode_rows = 0
        self.finished = self.rounds = self.drafted = self.accepted = 0
        self._reached, self._kept = [], []
        self._host_work = HostWork()
        self.busy_seconds = 0.0
        self._since = now
        return out


@dataclass(frozen=True)
class ContextCacheCounters:
    """Cumulative prefix-cache counters: lookups and hits, KV pages moved to and from the
    host tier, and recurrent-state snapshots (all zero where a feature is off)."""

    lookups: int
    lookup_tokens: int
    hit_tokens: int
    evicted_pages: int  # cached pages overwritten on the device
    spilled_pages: int  # ...of which a copy went to the host tier
    restored_pages: int  # host copies brought back for a hit
    host_pages: int  # pages held on the host now
    snapshot_captures: int
    snapshot_device_hits: int
    snapshot_host_hits: int
    snapshot_spills: int
    snapshot_drops: int
    #: context-cache checkpoints (ninfer.engine.context_cache.CheckpointStats)
    continuations_created: int = 0
    continuations_replaced: int = 0
    continuations_evicted: int = 0
    shared_prefixes_created: int = 0
    shared_prefixes_evicted: int = 0
    anchors_kept: int = 0
    anchors_dropped: int = 0
    checkpoints_forgotten: int = 0

    @classmethod
    def of(cls, scheduler) -> "ContextCacheCounters":
        bm = scheduler.block_manager
        # a model without recurrent state keeps no snapshots: all-zero counters
        snaps = scheduler.snapshots.stats if scheduler.snapshots is not None else SnapshotStats()
        marks = bm.context.stats if bm.context is not None else CheckpointStats()  # none without prefix reuse
        return cls(
            lookups=bm.num_lookups,
            lookup_tokens=bm.num_lookup_tokens,
            hit_tokens=bm.num_hit_tokens,
            evicted_pages=bm.num_evicted_blocks,
            spilled_pages=bm.num_spilled_blocks,
            restored_pages=bm.num_restored_blocks,
            host_pages=bm.cache.num_host_pages,
            snapshot_captures=snaps.captures,
            snapshot_device_hits=snaps.device_hits,
            snapshot_host_hits=snaps.host_hits,
            snapshot_spills=snaps.spills,
            snapshot_drops=snaps.drops,
            continuations_created=marks.continuations_created,
            continuations_replaced=marks.continuations_replaced,
            continuations_evicted=marks.continuations_evicted,
            shared_prefixes_created=marks.shared_created,
            shared_prefixes_evicted=marks.shared_evicted,
            anchors_kept=marks.anchors_kept,
            anchors_dropped=marks.anchors_dropped,
            checkpoints_forgotten=marks.forgotten,
        )

    def summary(self) -> str:
        """One line for the log."""
        line = (
            f"prefix cache: {self.hit_tokens}/{self.lookup_tokens} prompt tokens hit over {self.lookups} lookups; "
            f"KV pages evicted {self.evicted_pages} (to host {self.spilled_pages}, back {self.restored_pages}, "
            f"on host now {self.host_pages})"
        )
        if self.snapshot_captures:
            line += (
                f"; state snapshots taken {self.snapshot_captures}, hits {self.snapshot_device_hits} device + "
                f"{self.snapshot_host_hits} host, moved to host {self.snapshot_spills}, dropped {self.snapshot_drops}"
            )
        return line
