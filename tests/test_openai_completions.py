"""POST /v1/completions (legacy text completions) against a real server, through the openai SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from server_harness import server_fixture

from ninfer import LLM, SamplingParams
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer

server = server_fixture("--max-context", "256", "--prefill-chunk", "32", "--max-concurrency", "2")
MODEL = "tiny:qwen3"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


def complete(client, **kw):
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 5, **kw})


def test_registering_the_plugin_does_not_import_litestar():
    """The route module (and with it the web stack) loads only when a server builds its app."""
    code = ("import sys\nfrom ninfer.plugins import load_registry\n"
            "registry = load_registry(None)\nprotocol = registry.get('protocol', 'openai_completions')\n"
            "assert 'litestar' not in sys.modules, 'litestar was imported'\n"
            "assert callable(protocol.routes)\n")
    env = {**os.environ, "NINFER_PLUGINS": "openai_completions"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr


def test_string_and_token_id_prompts_agree(client, tokenizer):
    text = complete(client)
    ids = tokenizer.encode(PROMPT)
    same = complete(client, prompt=ids)
    assert text.object == "text_completion" and text.model == MODEL
    assert text.choices[0].text == same.choices[0].text
    assert text.usage.prompt_tokens == same.usage.prompt_tokens == len(ids)
    assert text.usage.total_tokens == text.usage.prompt_tokens + text.usage.completion_tokens
    assert text.choices[0].finish_reason in ("stop", "length") and text.choices[0].logprobs is None


def test_several_prompts_times_n_are_indexed_prompt_major(client, tokenizer):
    prompts = [PROMPT, "Once upon a time"]
    result = complete(client, prompt=prompts, n=2, max_tokens=4)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    single = complete(client, prompt=prompts[1], max_tokens=4)
    assert result.choices[2].text == single.choices[0].text  # same seed offset (0) for each prompt's first sample


def test_echo_prepends_the_prompt(client):
    plain = complete(client)
    echoed = complete(client, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert complete(client, echo=True, max_tokens=0).choices[0].text == PROMPT


def test_legacy_logprobs_shape(client):
    result = complete(client, logprobs=2)
    lp = result.choices[0].logprobs
    n = result.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob)


LONG = "Paged attention keeps the KV cache in fixed-size blocks, so that many requests of any length share " \
       "one pool of memory and a finished request hands its pages straight back"  # spans several 32-token chunks


def test_echo_logprobs_score_the_prompt_like_the_python_api(client, tokenizer):
    ids = tokenizer.encode(LONG)
    assert len(ids) > 64
    choice = complete(client, prompt=LONG, echo=True, logprobs=2, max_tokens=0).choices[0]
    lp = choice.logprobs
    assert choice.text == LONG
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == LONG
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert token in top and 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
    llm = LLM(MODEL, device="cpu", max_context=256, prefill_chunk=32)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert lp.token_logprobs[1:] == pytest.approx([p.logprob for p in want.prompt_logprobs[1:]], abs=1e-4)


def test_echo_logprobs_put_the_prompt_before_the_output(client):
    plain = complete(client, logprobs=1).choices[0]
    both = complete(client, echo=True, logprobs=1).choices[0]
    n_prompt = len(both.logprobs.tokens) - len(plain.logprobs.tokens)
    assert both.text == PROMPT + plain.text and n_prompt > 1
    assert both.logprobs.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs)
    assert both.logprobs.text_offset[n_prompt:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    chunks = list(complete(client, echo=True, logprobs=1, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert "".join(c.choices[0].text for c in chunks) == both.text
    assert streamed[0] is None and streamed[1:] == pytest.approx(both.logprobs.token_logprobs[1:])
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == both.logprobs.text_offset


def test_stream_concatenates_to_the_aggregate(client, server):
    aggregate = complete(client, max_tokens=12, echo=True)
    chunks = list(complete(client, max_tokens=12, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == aggregate.choices[0].text
    assert chunks[-1].choices[0].finish_reason == aggregate.choices[0].finish_reason
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_stop_string_truncates(client):
    text = complete(client, max_tokens=16).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    unmatched = [f"never{i}" for i in range(7)]  # more than chat's four: harnesses send long stop lists
    cut = complete(client, max_tokens=16, stop=[*unmatched, stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 6}, "logprobs"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": [PROMPT, 7]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": [100000]}, "prompt"),
    ({"prompt": [-16040, -16040]}, "prompt"),  # found by the schema fuzzer: the echo decode overflowed
    ({"prompt": [[1, 2], [3, -1]]}, "prompt[1]"),
    ({"temperature": 3}, "temperature"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),  # was silently ignored
    ({"stop": ["x"] * 33}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"max_tokens": "2"}, "max_tokens"),  # strict JSON types
    ({"echo": 1}, "echo"),
])
def test_rejections_name_their_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **kwargs)
    assert e.value.body["param"] == param, e.value.body


def test_the_neutral_repetition_penalty_is_accepted(client):
    assert complete(client, max_tokens=2, extra_body={"repetition_penalty": 1}).choices[0].text is not None


def test_model_must_match(client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, model="gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_min_tokens_and_ignore_eos_from_extra_body_are_honoured(client):
    """vLLM's extensions, as its clients send them; they used to be dropped as unknown fields."""
    def create(**kw):
        return complete(client, prompt="hello", max_tokens=60, **kw)

    seed = next((s for s in range(40) if (r := create(seed=s)).choices[0].finish_reason == "stop"
                 and r.usage.completion_tokens < 30), None)
    if seed is None:
        pytest.skip("the tiny model never stopped early")
    ignored = create(seed=seed, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 60
    held = create(seed=seed, extra_body={"min_tokens": 40})
    assert held.usage.completion_tokens > 40, held.usage
