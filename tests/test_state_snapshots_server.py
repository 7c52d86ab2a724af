"""A hybrid model behind a real ``ninfer-serve``: a chat's second turn resumes from the first
turn's state snapshot (OpenAI SDK, tiny Qwen3.5 checkpoint)."""

from __future__ import annotations

import openai
from server_harness import running_server

MODEL = "tiny:qwen3_5"
SYSTEM = "You are a patient assistant. Answer every question in one short sentence, and keep to the facts."


def test_second_turn_reports_cached_tokens():
    with running_server("--max-context", "512", "--prefill-chunk", "16", "--block-size", "16",
                        "--greedy", model=MODEL) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers."}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content or "Rivers."},
                     {"role": "user", "content": "And three mountains?"}]
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # at least the first turn's prompt up to a page before its end (its generation prompt differs)
        assert cached >= first.usage.prompt_tokens - 2 * 16 and cached % 16 == 0
        assert "recurrent state: 1 slots + 1 snapshot rows" in base_url.logs()
