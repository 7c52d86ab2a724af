"""``--default-thinking-budget`` through Chat Completions, with the openai SDK.

The tiny model never opens reasoning by itself, so a logit bias makes ``<think>`` its
every token: the first opens reasoning, the rest fill it until the budget closes it.
"""

from __future__ import annotations

import openai
import pytest
from server_harness import server_fixture

from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer

BUDGET = 3
server = server_fixture("--max-context", "512", "--default-thinking-budget", str(BUDGET),
                        "--protocols", "openai_chat", "--log-stats-interval-ms", "0")
GUIDANCE = QWEN3.budget_close
MESSAGES = [{"role": "user", "content": "Think it over."}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def think_bias(tokenizer) -> dict[str, int]:
    return {str(tokenizer.token_to_id("<think>")): 100}


def test_the_budget_closes_reasoning_with_guidance_and_the_answer_follows(client, tokenizer, think_bias):
    close = len(tokenizer.encode(GUIDANCE))
    max_tokens = 1 + BUDGET + close + 3
    result = client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, max_tokens=max_tokens,
                                            logit_bias=think_bias, temperature=0)
    message = result.choices[0].message
    # the opening marker (not counted), BUDGET reasoning tokens, then the inserted close
    assert message.reasoning_content == "<think>" * BUDGET + GUIDANCE.split("</think>")[0].rstrip("\n")
    assert message.content == "<think>" * (max_tokens - 1 - BUDGET - close)  # the model went on after it
    assert result.usage.completion_tokens == max_tokens  # inserted tokens count as output

    chunks = list(client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, max_tokens=max_tokens,
                                                 logit_bias=think_bias, temperature=0, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content  # the guidance streams as reasoning


def test_requests_that_do_not_think_get_no_budget(client, think_bias):
    result = client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, max_tokens=8,
                                            logit_bias=think_bias, temperature=0,
                                            extra_body={"enable_thinking": False})
    message = result.choices[0].message
    assert "Considering" not in (message.reasoning_content or "") + (message.content or "")


def test_an_output_limit_that_cannot_hold_the_close_is_refused(client, tokenizer, think_bias):
    tight = BUDGET + len(tokenizer.encode(GUIDANCE))  # the close fits, one answer token does not
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, max_completion_tokens=tight)
    assert (e.value.body["code"], e.value.body["param"]) == ("thinking_budget_capacity_insufficient",
                                                            "max_completion_tokens")
    ok = client.chat.completions.create(model="tiny:qwen3", messages=MESSAGES, max_tokens=BUDGET,
                                        logit_bias=think_bias)
    assert ok.usage.completion_tokens == BUDGET  # the budget is never reached: nothing to fit
