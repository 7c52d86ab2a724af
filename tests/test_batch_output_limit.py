"""The batch format's max_generate_length: a ceiling fitted to the context and the KV pool,
and 0 (as the server's max_tokens: 0) reads the prompt without generating."""

from __future__ import annotations

import pytest

from ninfer.batch import parse_batch
from ninfer.batch.runner import run_batch

CONTEXT, KV = 256, 64


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    # a KV pool smaller than the context: one request can hold at most KV tokens
    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=CONTEXT, kv_capacity=KV, max_concurrency=2)


def run(llm, document: dict):
    return run_batch(llm, parse_batch(document), warn=lambda _: None).results


def raw(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def test_the_default_length_is_fitted_to_the_kv_pool(llm):
    """The default of 256 exceeds the 64-token pool; the request runs, within the pool."""
    (result,) = run(llm, {"apply_chat_template": False, "temperature": 0, "requests": [raw("count with me")]})
    assert result.error is None, result.error
    assert result.generated_tokens > 0 and result.prompt_tokens + result.generated_tokens <= KV


def test_zero_reads_the_prompt_and_generates_nothing(llm):
    (result,) = run(llm, {"apply_chat_template": False, "max_generate_length": 0, "num_logprobs": 3,
                          "requests": [raw("count with me")]})
    assert result.error is None, result.error
    assert (result.generated_tokens, result.output_text, result.logprobs) == (0, "", [])
    assert result.prompt_tokens > 0


def test_a_prompt_filling_the_pool_fails_naming_its_messages(llm):
    (ok, full) = run(llm, {"apply_chat_template": False, "max_generate_length": 4,
                           "requests": [raw("short"), raw("word " * 200)]})
    assert ok.error is None and ok.generated_tokens <= 4
    assert full.finish_reason == "error" and full.error.startswith("requests[1].messages")
