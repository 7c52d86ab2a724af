"""Speculative decoding as users see it: the server's timings, the batch runner's summary."""

from __future__ import annotations

import json

import httpx
from server_harness import running_server

from ninfer import LLM, SamplingParams
from ninfer.batch.runner import run_batch
from ninfer.batch.output import summary_json
from ninfer.batch.schema import parse_batch

REPEATING = "one two three four one two three four one two three four one two"


def test_the_server_reports_drafts_in_llama_cpp_timings():
    with running_server("--spec", "ngram", "--draft-tokens", "3", "--max-context", "512") as url:
        body = {"messages": [{"role": "user", "content": REPEATING}], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        timings = answer["timings"]
        assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0 and timings["draft_n"] > 0
        assert answer["usage"]["completion_tokens"] == 24
        assert "speculative decoding: ngram" in url.logs()
    with running_server("--max-context", "512") as url:  # without speculation the fields are absent
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert "draft_n" not in answer["timings"]


def test_the_batch_runner_speculates_per_request_and_reports_it(tiny_qwen3):
    settings = dict(dtype="fp32", device="cpu", max_concurrency=4, block_size=4, max_context=256)
    plain, spec = LLM(str(tiny_qwen3), **settings), LLM(str(tiny_qwen3), spec="ngram", draft_tokens=3, **settings)
    doc = {"temperature": 0.0, "max_generate_length": 24, "apply_chat_template": False,
           "requests": [{"messages": [{"role": "user", "content": REPEATING}]},
                        {"messages": [{"role": "user", "content": REPEATING}], "disable_spec_decode": True}]}
    expected = [r.output_text for r in run_batch(plain, parse_batch(json.loads(json.dumps(doc))), warn=print).results]
    batch = parse_batch(doc)
    run = run_batch(spec, batch, warn=print)
    assert [r.output_text for r in run.results] == expected
    summary = summary_json(run, batch, "tiny", 0.0)["speculative_decoding"]
    assert summary["backend"] == "ngram" and summary["requests_disabling"] == 1
    assert summary["rounds"] > 0 and summary["draft_tokens"] >= summary["accepted_tokens"]
    assert summary["acceptance_length"] >= 1.0
