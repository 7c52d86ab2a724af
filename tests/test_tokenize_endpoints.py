"""vLLM's POST /tokenize and /detokenize on a real server: the ids the engine would see."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import server_fixture

server = server_fixture("--max-context", "256", "--max-concurrency", "2")


@pytest.fixture(scope="module")
def tokenizer():
    from ninfer.tiny.cache import resolve_model_path
    from ninfer.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_model_path("tiny:qwen3"))


def _post(server: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=30)


def test_a_raw_prompt_tokenizes_and_detokenizes_back(server, tokenizer):
    r = _post(server, "/tokenize", {"prompt": "Hello there, tokens!", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello there, tokens!")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == [tokenizer.id_to_token(i) for i in body["tokens"]]
    back = _post(server, "/detokenize", {"tokens": body["tokens"], "model": "tiny:qwen3"})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello there, tokens!"}


def test_chat_messages_count_what_chat_completions_bills(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    done = client.chat.completions.create(model="tiny:qwen3", messages=messages, max_tokens=1)
    assert r.json()["count"] == done.usage.prompt_tokens
    assert r.json()["token_strs"] is None
    # the open assistant turn is part of it: without it the prompt is shorter
    shorter = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert shorter["count"] < r.json()["count"]
    assert r.json()["tokens"][: shorter["count"]] == shorter["tokens"]


def test_a_template_that_refuses_the_messages_is_a_400(server):
    """Rendered by the pipeline's render, refusals included: this template drops the
    reasoning of the message to continue, so it cannot be continued."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>r</think>b"}]
    r = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                    "continue_final_message": True})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_prompt", "messages")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_malformed_json_is_a_400(server, path):
    r = httpx.post(f"{server}{path}", content=b'{"tokens": [1,', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt", 400),
    ("/tokenize", {}, "messages", 400),
    ("/tokenize", {"prompt": 5}, "prompt", 400),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model", 404),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"foo": 1}},
     "chat_template_kwargs.foo", 400),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0]", 400),
    ("/detokenize", {"tokens": [1, 10_000_000]}, "tokens[1]", 400),
    ("/detokenize", {"tokens": "12"}, "tokens", 400),
])
def test_bad_bodies_name_the_field(server, path, body, param, status):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_api_key_guards_them():
    from server_harness import running_server

    with running_server("--api-key", "sekrit", "--max-context", "128") as url:
        assert httpx.post(f"{url}/tokenize", json={"prompt": "a"}).status_code == 401
        ok = httpx.post(f"{url}/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
