"""``GET /metrics`` on a real server, read back with prometheus_client's own parser.

After known traffic the counters must match what the responses reported, exactly:
finished requests, prompt and generated tokens (usage), one latency observation per
request, and the speculative counters (the drafts llama.cpp-style timings reported).
"""

from __future__ import annotations

import json
import types

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from server_harness import server_fixture

from ninfer.server.metrics import ServerMetrics

KEY = "metrics-key"
HEADERS = {"x-api-key": KEY}
MODEL = "tiny:qwen3"
REPEATING = "one two three four one two three four one two three four one two"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
server = server_fixture("--api-key", KEY, "--spec", "ngram", "--draft-tokens", "3", "--max-context", "512",
                        "--log-stats-interval-ms", "0")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    response = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            assert s.labels["model_name"] == MODEL
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_metrics_need_the_key(server):
    assert httpx.get(f"{server}/metrics", timeout=30).status_code == 401


def test_counters_match_the_traffic_exactly(server):
    before = scrape(server)
    usages, drafted, accepted = [], 0, 0
    for _ in range(3):  # the same prompt: its pages are cached after the first
        body = {"model": MODEL, "messages": [{"role": "user", "content": REPEATING}], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, **NO_THINKING}
        answer = httpx.post(f"{server}/v1/chat/completions", json=body, headers=HEADERS, timeout=120).json()
        usages.append(answer["usage"])
        drafted += answer["timings"].get("draft_n", 0)
        accepted += answer["timings"].get("draft_n_accepted", 0)
    stream = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True,
              "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True, **NO_THINKING}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=stream, headers=HEADERS, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages.append(chunks[-1]["usage"])
    drafted += chunks[-1].get("timings", {}).get("draft_n", 0)
    accepted += chunks[-1].get("timings", {}).get("draft_n_accepted", 0)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(usages)
    assert delta("vllm:request_success_total") == n
    assert delta("vllm:request_success_total", finished_reason="length") == n  # ignore_eos: every one hit max_tokens
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert delta(f"{histogram}_count") == n, histogram
        assert delta(f"{histogram}_bucket", le="+Inf") == n
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= sum(u["completion_tokens"] - 1 for u in usages)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == drafted > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert 0 < delta("vllm:spec_decode_num_drafts_total") <= drafted
    assert delta("vllm:prefix_cache_hits_total") > 0  # the repeated prompt's pages
    assert total(after, "vllm:prefix_cache_queries_total") >= total(after, "vllm:prefix_cache_hits_total")
    assert total(after, "vllm:num_requests_running") == total(after, "vllm:num_requests_waiting") == 0
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1
    # every finished request leaves a private continuation; a repeat replaces its conversation's last one
    assert delta("ninfer:context_checkpoint_events_total", event="continuations_created") == n
    assert delta("ninfer:context_checkpoint_events_total", event="continuations_replaced") >= 1
    assert total(after, "ninfer:context_checkpoints", kind="private_continuation") >= 1
    for name in ("ninfer:state_snapshot_captures_total", "ninfer:host_kv_spilled_pages_total",
                 "ninfer:host_kv_pages", "ninfer:requests_in_flight"):
        assert (name, (("model_name", MODEL),)) in after, name


def test_each_server_has_its_own_registry():
    """Two servers in one process: no clash in (or use of) prometheus_client's global registry."""
    state = types.SimpleNamespace()  # the engine collector reads it only when scraped
    first, second = ServerMetrics("a", state), ServerMetrics("b", state)
    assert REGISTRY not in (first.registry, second.registry)
    first.prompt_tokens.labels("a").inc(3)
    name = "vllm:prompt_tokens_total"

    def value(metrics: ServerMetrics, model: str):
        # restricted to the named counters: the engine collector (no engine here) is left out
        samples = (s for m in metrics.registry.restricted_registry([name]).collect() for s in m.samples)
        return next((s.value for s in samples if s.name == name and s.labels == {"model_name": model}), None)

    assert (value(first, "a"), value(second, "a")) == (3.0, None)
