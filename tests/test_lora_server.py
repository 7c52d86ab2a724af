"""LoRA adapters in the server: ``--lora-modules NAME=PATH``, a request's ``model`` picks one."""

from __future__ import annotations

import httpx
import openai
import pytest

from ninfer import LLM, SamplingParams
from server_harness import running_server, start_server, stop_server
from test_lora import adapters  # noqa: F401  (the PEFT adapters fixture)

PROMPT = [{"role": "user", "content": "Tell me about the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tiny_qwen3, adapters):  # noqa: F811
    flags = ("--lora-modules", f"A={adapters['A']},B={adapters['B']}", "--max-context", "256",
             "--max-concurrency", "4")
    with running_server(*flags, model=str(tiny_qwen3)) as url:
        yield url


def _greedy_reference(tiny_qwen3, adapters, name):  # noqa: F811
    llm = LLM(str(tiny_qwen3), lora_modules={k: str(v) for k, v in adapters.items()}, dtype="fp32", device="cpu")
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=8), lora_name=name)
    return out[0].outputs[0].text


def test_models_lists_the_adapters_under_the_base(server, tiny_qwen3):
    listing = httpx.get(f"{server}/v1/models").json()
    base = tiny_qwen3.name
    assert [(m["id"], m["parent"]) for m in listing["data"]] == [(base, None), ("A", base), ("B", base)]
    assert httpx.get(f"{server}/v1/models/B").json()["parent"] == base
    assert httpx.get(f"{server}/v1/models/C").status_code == 404


def test_the_model_field_picks_the_adapter_in_every_protocol(server, tiny_qwen3, adapters):  # noqa: F811
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    texts = {}
    for model in (tiny_qwen3.name, "A", "B"):
        done = chat.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0)
        assert done.model == model
        texts[model] = done.choices[0].message.content
    assert texts["A"] == _greedy_reference(tiny_qwen3, adapters, "A")
    assert texts["B"] == _greedy_reference(tiny_qwen3, adapters, "B")
    assert texts[tiny_qwen3.name] == _greedy_reference(tiny_qwen3, adapters, None)
    assert len(set(texts.values())) == 3, texts  # the adapters change the output
    # the other front doors select the same way
    resp = chat.responses.create(model="A", input=PROMPT, max_output_tokens=8, temperature=0)
    assert resp.output_text == texts["A"]
    legacy = chat.completions.create(model="B", prompt="Hello", max_tokens=4, temperature=0)
    assert legacy.model == "B"
    with pytest.raises(openai.NotFoundError) as err:
        chat.chat.completions.create(model="C", messages=PROMPT, max_tokens=2)
    assert "'A'" in str(err.value) and "'B'" in str(err.value)


def test_bad_lora_modules_stop_startup_with_a_reason(tiny_qwen3, tmp_path, capsys):
    from ninfer.cli import serve

    assert serve.main([str(tiny_qwen3), "--lora-modules", "nameonly", "--check"]) == 2
    assert "'nameonly' must be NAME=PATH" in capsys.readouterr().err
    assert serve.main([str(tiny_qwen3), "--lora-modules", "A=/x,A=/y", "--check"]) == 2
    assert "given twice" in capsys.readouterr().err
    # a directory without an adapter: the engine does not start, and the log says why
    with pytest.raises(RuntimeError, match="cannot start the engine: LoraAdapterError"):
        url = start_server("--lora-modules", f"A={tmp_path}", model=str(tiny_qwen3))
        stop_server(url)
