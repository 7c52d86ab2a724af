"""``GET /metrics``: Prometheus text exposition under the names vLLM users already chart.

Each server has its own ``CollectorRegistry`` (never the process-global one), so tests can
run several servers in one process. Two kinds of figures:

- per request, counted when a generation request ends (:mod:`ninfer.frontend.lifecycle`):
  token totals, finished requests by reason, and the latency histograms;
- engine state read when scraped, by a collector: scheduler gauges, KV usage, the prefix
  cache's and the speculative rounds' cumulative counters, and the ninfer-named
  host-tier and state-snapshot counters. Reading plain ints the engine thread updates
  needs no lock; a scrape may see one step's counters half-updated, never corrupt ones.

Every series carries ``model_name``. The route needs the API key when one is set (the
app-wide guard covers every route but ``/health`` and ``HEAD /``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Iterator

from litestar import Response, get
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ninfer.engine.context_cache import CheckpointStats
from ninfer.engine.state_cache import SnapshotStats
from ninfer.frontend.lifecycle import Rejection, failure_kind
from ninfer.frontend.pipeline import Run

LABEL = "model_name"
# vLLM's bucket boundaries, so dashboards built for it read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The registry of one server, and a request observer feeding it."""

    def __init__(self, model_name: str, state: Any):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, [LABEL]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests (usage).",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests (usage).",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished engine requests (choices) by finish reason.",
                                       [LABEL, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From arrival to the first token.", labels,
                              registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between successive token deliveries of a choice.",
                             labels, registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "From arrival to the end of the choice.", labels,
                             registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time in the engine's FIFO before admission.",
                               labels, registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        self.rejected_requests = Counter("ninfer:requests_rejected", "Generation requests refused before starting.",
                                         [LABEL, "phase", "code"], registry=r)
        r.register(EngineCollector(model_name, state))

    # -- request observer ----------------------------------------------------------
    def rejected(self, rejection: Rejection) -> None:
        code = getattr(rejection.error, "code", "internal_error")
        self.rejected_requests.labels(self.model_name, rejection.phase, code).inc()

    def started(self, run: Run) -> None:
        pass  # running and waiting are engine gauges, read when scraped

    def ended(self, run: Run) -> None:
        life, name = run.life, self.model_name
        assert life is not None
        usage = run.usage()
        self.prompt_tokens.labels(name).inc(usage.prompt_tokens)
        self.generation_tokens.labels(name).inc(usage.completion_tokens)
        unfinished = "abort" if failure_kind(life.failure) == "cancelled" else "error"
        for choice in run.choices:
            if not choice.started:  # never reached the engine (refused there or never sent)
                continue
            self.request_success.labels(name, choice.finish_reason if choice.finished else unfinished).inc()
            t = choice.timings
            if t is not None and t.first_token is not None:
                self.ttft.labels(name).observe(max(t.first_token - life.arrived, 0.0))
            if t is not None and t.admitted is not None:
                self.queue.labels(name).observe(max(t.admitted - t.arrival, 0.0))
            end = choice.finished_at if choice.finished_at is not None else life.ended_at
            if end is not None:
                self.e2e.labels(name).observe(max(end - life.arrived, 0.0))
            itl = self.itl.labels(name)
            for gap in choice.token_gaps:
                itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _counter(name: str, doc: str, model: str, value: float, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[LABEL, *extra])
    if not extra:
        family.add_metric([model], value)
    return family


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[LABEL])
    family.add_metric([model], value)
    return family


class EngineCollector:
    """Engine state, read at each scrape (on the event loop, while the engine thread runs)."""

    def __init__(self, model_name: str, state: Any):
        self.model_name, self.state = model_name, state

    def collect(self) -> Iterator[Metric]:
        m, engine = self.model_name, self.state.engine.engine
        sched, bm, stats = engine.scheduler, engine.block_manager, engine.stats
        yield _gauge("vllm:num_requests_running", "Requests admitted by the engine (prefilling or decoding).", m,
                     sched.num_running)
        yield _gauge("vllm:num_requests_waiting", "Requests queued in the engine's FIFO.", m, sched.num_waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", m, bm.usage())
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m,
                       bm.num_lookup_tokens)
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, bm.num_hit_tokens)
        if engine.proposer is not None:  # as vLLM: only a speculating server has these
            yield _counter("vllm:spec_decode_num_drafts", "Verify rounds that carried drafts.", m, stats.total_rounds)
            yield _counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, stats.total_drafted)
            yield _counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, stats.total_accepted)
            per_pos = _counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.",
                               m, 0, ("position",))
            for position, kept in enumerate(list(stats.total_kept)):
                per_pos.add_metric([m, str(position)], kept)
            yield per_pos
        yield from self._ninfer(m, engine)

    def _ninfer(self, m: str, engine: Any) -> Iterator[Metric]:
        """What vLLM has no name for: admission, the host KV tier, recurrent-state snapshots."""
        sched, bm = engine.scheduler, engine.block_manager
        yield _gauge("ninfer:requests_in_flight", "HTTP generation requests holding a capacity slot.", m,
                     self.state.gate.in_flight)
        yield _gauge("ninfer:num_requests_prefilling", "Admitted requests still computing their prompt.", m,
                     sched.num_prefilling)
        yield _gauge("ninfer:kv_cache_pages", "KV pages on the device.", m, bm.num_blocks)
        yield _gauge("ninfer:kv_cache_cached_pages", "Free KV pages still holding reusable prefixes.", m,
                     bm.num_cached_blocks)
        yield _counter("ninfer:prefix_cache_lookups", "Prefix-cache lookups (one per admitted request that looked).",
                       m, bm.num_lookups)
        yield _counter("ninfer:kv_evicted_pages", "Cached KV pages overwritten on the device.", m,
                       bm.num_evicted_blocks)
        host = bm.host_kv
        yield _counter("ninfer:host_kv_spilled_pages", "Evicted KV pages copied to the host tier.", m,
                       bm.num_spilled_blocks)
        yield _counter("ninfer:host_kv_restored_pages", "Host-tier KV pages copied back for a hit.", m,
                       bm.num_restored_blocks)
        yield _gauge("ninfer:host_kv_pages", "KV pages held in the host tier.", m, bm.cache.num_host_pages)
        yield _gauge("ninfer:host_kv_capacity_pages", "KV pages the host tier can hold.", m,
                     host.capacity if host is not None else 0)
        yield _gauge("ninfer:host_kv_allocated_bytes", "Pinned host memory the tier has allocated.", m,
                     host.allocated_bytes if host is not None else 0)
        snapshots = sched.snapshots
        snaps = snapshots.stats if snapshots is not None else SnapshotStats()
        yield _gauge("ninfer:state_snapshots", "Recurrent-state snapshots held (device and host).", m,
                     len(snapshots) if snapshots is not None else 0)
        for field, doc in (("captures", "taken"), ("device_hits", "restored from the device"),
                           ("host_hits", "restored from the host tier"), ("spills", "moved to the host tier"),
                           ("drops", "discarded")):
            yield _counter(f"ninfer:state_snapshot_{field}", f"Recurrent-state snapshots {doc}.", m,
                           getattr(snaps, field))
        yield from self._checkpoints(m, bm)

    def _checkpoints(self, m: str, bm: Any) -> Iterator[Metric]:
        """The context cache's checkpoints (docs/context-cache.md): held now, and what happened to them."""
        context = bm.context
        held = GaugeMetricFamily("ninfer:context_checkpoints", "Context-cache checkpoint owners held.",
                                 labels=[LABEL, "kind"])
        held.add_metric([m, "private_continuation"], context.num_continuations if context is not None else 0)
        held.add_metric([m, "shared_stable_prefix"], context.num_shared if context is not None else 0)
        yield held
        stats = context.stats if context is not None else CheckpointStats()
        events = CounterMetricFamily("ninfer:context_checkpoint_events", "Context-cache checkpoint events.",
                                     labels=[LABEL, "event"])
        for event in fields(CheckpointStats):
            events.add_metric([m, event.name], getattr(stats, event.name))
        yield events


def metrics_route(metrics: ServerMetrics) -> Any:
    @get("/metrics", summary="Prometheus metrics", tags=["server"], sync_to_thread=False, include_in_schema=False)
    def prometheus_metrics() -> Response[bytes]:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return prometheus_metrics
