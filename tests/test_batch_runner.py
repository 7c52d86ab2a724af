"""``ninfer-run`` and the batch runner: the input format's fields, results, errors, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.batch import BatchInputError, parse_batch, parse_batch_json
from ninfer.batch import runner as runner_mod
from ninfer.batch.output import output_document, write_json_atomic
from ninfer.batch.runner import _Preparer, batch_prompt, run_batch

RUN = Path(sys.executable).with_name("ninfer-run")
MODEL_FLAGS = ["--device", "cpu", "--dtype", "fp32", "--max-context", "256"]


def user(text) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def cli(tmp_path: Path, document, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    source = tmp_path / "requests.json"
    source.write_text(document if isinstance(document, str) else json.dumps(document), encoding="utf-8")
    out = tmp_path / "results.json"
    result = subprocess.run([str(RUN), "--input", str(source), "--output", str(out), *args],
                            capture_output=True, text=True, env=dict(os.environ), timeout=300)
    return result, out


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=256, max_concurrency=4)


def run(llm, document: dict, warnings: list[str] | None = None):
    sink = warnings if warnings is not None else []
    return run_batch(llm, parse_batch(document), warn=sink.append).results


# -- the console script ----------------------------------------------------------------------
def test_cli_runs_a_batch_and_failed_requests_do_not_stop_the_others(tmp_path, tiny_qwen3):
    document = {
        "batch_size": 2, "sampling_seed": 3, "max_generate_length": 8, "spec_proposal_sampling": "greedy",
        "requests": [
            user("first"),
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "/no/such.jpg"},
                                                       {"type": "text", "text": "Describe it."}]}]},
            {**user("pick one"), "guided_decoding": {"regex": "(unclosed"}},
            {**user("last"), "num_logprobs": 2, "disable_spec_decode": True, "save_system_prompt_kv_cache": True},
        ],
    }
    result, out = cli(tmp_path, document, str(tiny_qwen3), *MODEL_FLAGS)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    assert "image content is not supported" in results[1]["error"] and "requests[1].messages[0].content[0]" in results[1]["error"]
    assert results[2]["error"].startswith("requests[2].guided_decoding.regex: invalid regex")
    for ok in (results[0], results[3]):
        assert "error" not in ok and ok["generated_tokens"] == 8 and ok["finish_reason"] == "length"
        assert ok["prompt_tokens"] > 0 and isinstance(ok["output_text"], str)
    assert "logprobs" not in results[0] and len(results[3]["logprobs"]) == 8
    summary = doc["summary"]
    assert (summary["requests"], summary["succeeded"], summary["failed"]) == (4, 2, 2)
    assert summary["generated_tokens"] == 16 and summary["seconds"] > 0 and summary["output_tokens_per_second"] > 0
    assert summary["speculative_decoding"] == {"backend": None, "proposal_sampling": "greedy", "requests_disabling": 1,
                                               "rounds": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                               "acceptance_length": None}
    assert "it/s" not in result.stderr and "req/s" not in result.stderr  # no progress bar off a terminal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.json", "results.json"]  # no temp file left


BAD_INPUTS = [
    ("{not json", "input: not valid JSON"),
    ('{"requests": [{"messages": [{"role": "user", "content": "x"}]}], "temperature": NaN}', "input: not valid JSON"),
    ({"requests": []}, "requests: must be a non-empty array"),
    ({"batch_size": 2}, "requests: is required"),
    ({"requests": [user("a"), user("b"), user("c"), {**user("d"), "logit_bias": {"12": 150}}]},
     'requests[3].logit_bias["12"]: must be a number in [-100, 100]'),
    ({"logit_bias": {"7": "high"}, "requests": [user("a")]}, 'logit_bias["7"]: must be a number in [-100, 100]'),
    ({"requests": [{**user("a"), "lora_name": "french"}]}, 'requests[0].lora_name: "french" is not in available_lora_weights'),
    ({"num_logprobs": 51, "requests": [user("a")]}, "num_logprobs: must be an integer in [0, 50]"),
]


@pytest.mark.parametrize("document,message", BAD_INPUTS)
def test_cli_malformed_input_exits_2_naming_the_path_and_writes_nothing(tmp_path, document, message):
    result, out = cli(tmp_path, document, "tiny:qwen3")
    assert result.returncode == 2
    assert message in result.stderr
    assert not out.exists() and result.stdout == ""


def test_cli_output_folder_must_exist(tmp_path):
    source = tmp_path / "requests.json"
    source.write_text(json.dumps({"requests": [user("a")]}))
    missing = tmp_path / "nowhere" / "results.json"
    result = subprocess.run([str(RUN), "--input", str(source), "--output", str(missing), "tiny:qwen3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--output" in result.stderr and not missing.parent.exists()


# -- validation, in-process --------------------------------------------------------------------
@pytest.mark.parametrize("document,message", [
    ({"requests": [user("a")], "logit_bias": {"abc": 1}}, 'logit_bias["abc"]: key must be a non-negative integer'),
    ({"requests": [user("a")], "logit_bias": {"-3": 1}}, 'logit_bias["-3"]: key must be a non-negative integer'),
    ({"requests": [user("a")], "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias: has 1025 entries"),
    ({"requests": [{**user("a"), "num_logprobs": -1}]}, "requests[0].num_logprobs: must be an integer in [0, 50]"),
    ({"requests": [user("a")], "temperature": "hot"}, "temperature: must be a number >= 0.0"),
    ({"requests": [user("a")], "top_p": 0}, "top_p: must be a number > 0.0 and <= 1.0"),
    ({"requests": [user("a")], "batch_size": True}, "batch_size: must be an integer >= 1"),
    ({"requests": [{**user("a"), "sampling_seed": 2**64}]}, "requests[0].sampling_seed: must be an integer in"),
    ({"requests": [{"messages": "hi"}]}, "requests[0].messages: must be a non-empty array"),
    ({"requests": [{"messages": [{"role": "tool", "content": "x"}]}]}, "requests[0].messages[0].role: must be one of"),
    ({"requests": [{"messages": [{"role": "user", "content": [{"type": "gif"}]}]}]},
     "requests[0].messages[0].content[0].type: must be one of"),
    ({"requests": [{**user("a"), "stop": ["ok", ""]}]}, "requests[0].stop: must be a non-empty string or an array"),
    ({"requests": [{**user("a"), "guided_decoding": {"regex": "a+", "choice": ["a"]}}]},
     "requests[0].guided_decoding: must set exactly one of"),
    ({"requests": [user("a")], "guided_decoding": {"json_schema": "{broken"}}, "guided_decoding.json_schema: is a string but not valid JSON"),
    ({"requests": [user("a")], "context_cache_lookup_policy": "never"}, 'context_cache_lookup_policy: must be one of "use_cache", "bypass"'),
    ({"requests": [user("a")], "available_lora_weights": {"fr": 3}}, 'available_lora_weights["fr"]: must be a non-empty file path'),
])
def test_validation_names_the_json_path(document, message):
    with pytest.raises(BatchInputError) as info:
        parse_batch(document)
    assert any(e.startswith(message) for e in info.value.errors), info.value.errors


def test_validation_reports_every_problem_and_warns_on_unknown_fields():
    with pytest.raises(BatchInputError) as info:
        parse_batch_json(json.dumps({"top_k": -1, "requests": [{**user("a"), "num_logprobs": 99}]}))
    assert len(info.value.errors) == 2
    batch = parse_batch({"temprature": 0.5, "requests": [user("a")]})
    assert batch.warnings == ["temprature: unknown field, ignored (did you mean temperature?)"]


def test_request_fields_override_global_defaults():
    batch = parse_batch({
        "sampling_seed": 1, "logit_bias": {"5": 1.5}, "num_logprobs": 2, "guided_decoding": {"regex": "a"},
        "requests": [user("a"), {**user("b"), "sampling_seed": 2**64 - 1, "logit_bias": {}, "num_logprobs": 0,
                                 "guided_decoding": {"choice": '["x", "y"]'}, "stop": "##"}],
    })
    first, second = batch.requests
    assert (first.sampling_seed, first.logit_bias, first.num_logprobs, first.guided_decoding, first.stop) == (
        1, {5: 1.5}, 2, {"regex": "a"}, [])
    assert (second.sampling_seed, second.logit_bias, second.num_logprobs, second.stop) == (2**64 - 1, {}, 0, ["##"])
    assert second.guided_decoding == {"choice": '["x", "y"]'}


# -- running, in-process -------------------------------------------------------------------------
PROMPTS = ["alpha beta", "the cat sat on", "numbers 1 2 3 4 5 6 7", "zzz"]


def test_seeded_results_keep_input_order_and_do_not_depend_on_batch_size(llm):
    def document(batch_size: int) -> dict:
        return {"batch_size": batch_size, "sampling_seed": 12345, "max_generate_length": 10,
                "context_cache_lookup_policy": "bypass", "requests": [user(p) for p in PROMPTS]}

    one, four = run(llm, document(1)), run(llm, document(4))
    assert [r.index for r in four] == list(range(len(PROMPTS)))
    assert [(r.output_text, r.generated_tokens) for r in one] == [(r.output_text, r.generated_tokens) for r in four]
    assert len({r.output_text for r in one}) > 1  # the prompts really produce different outputs


def test_raw_mode_concatenates_message_texts_and_template_mode_renders(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    raw = parse_batch({"apply_chat_template": False, "max_generate_length": 2, "requests": [{"messages": messages}]})
    templated = parse_batch({"max_generate_length": 2, "requests": [{"messages": messages}]})
    no_gen = parse_batch({"add_generation_prompt": False, "enable_thinking": True, "requests": [{"messages": messages}]})
    assert llm.pipeline.render(batch_prompt(raw, raw.requests[0])).text == "Be brief.Hi there"
    text = llm.pipeline.render(batch_prompt(templated, templated.requests[0])).text
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "Hi there" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking is off by default
    assert not llm.pipeline.render(batch_prompt(no_gen, no_gen.requests[0])).text.endswith("assistant\n")
    results = run_batch(llm, raw, warn=print).results + run_batch(llm, templated, warn=print).results
    assert results[0].prompt_tokens == len(tok.encode("Be brief.Hi there"))
    assert results[1].prompt_tokens == len(tok.encode(text))


def test_stop_strings_cut_the_text_and_the_earliest_match_wins(llm):
    base = {"temperature": 0.0, "max_generate_length": 20, "requests": [user("the cat sat on")]}
    full = run(llm, base)[0].output_text
    # two ASCII pieces at distinct first positions; list the later one first
    starts = [i for i in range(2, len(full) - 1) if full[i:i + 2].isascii() and full.find(full[i:i + 2]) == i]
    assert len(starts) >= 2, full
    early, late = full[starts[0]:starts[0] + 2], full[starts[-1]:starts[-1] + 2]
    stopped = run(llm, {**base, "requests": [{**user("the cat sat on"), "stop": [late, early]}]})[0]
    assert stopped.finish_reason == "stop-words" and stopped.stop_reason == early
    assert stopped.output_text == full[:starts[0]]
    single = run(llm, {**base, "requests": [{**user("the cat sat on"), "stop": late}]})[0]
    assert single.output_text == full[:starts[-1]] and single.finish_reason == "stop-words"


def test_logprobs_have_the_spec_shape_and_a_batch_uniform_k(llm):
    tok = llm.get_tokenizer()
    results = run(llm, {"batch_size": 2, "sampling_seed": 9, "max_generate_length": 5,
                        "requests": [user("a"), {**user("b"), "num_logprobs": 3}, {**user("c"), "num_logprobs": 1}]})
    assert [len(r.logprobs[0]) for r in results] == [3, 3, 1]  # groups of batch_size share their largest K
    # seeded: an unseeded run could sample end-of-sequence early and end with fewer steps
    document = output_document(run_batch(llm, parse_batch({"num_logprobs": 4, "max_generate_length": 5,
                                                           "sampling_seed": 9, "requests": [user("d")]}), warn=print),
                               parse_batch({"requests": [user("d")]}), "tiny", 0.0)
    steps = document["results"][0]["logprobs"]
    assert len(steps) == document["results"][0]["generated_tokens"] >= 1
    for step in steps:
        assert [set(c) for c in step] == [{"token_id", "token", "bytes", "logprob"}] * 4
        lps = [c["logprob"] for c in step]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        for c in step:
            assert c["bytes"] == list(tok.token_bytes(c["token_id"]))
            assert c["token"] == bytes(c["bytes"]).decode("utf-8", errors="replace")


def test_logprobs_describe_the_temperature_one_distribution(llm):
    def first_step(temperature: float):
        document = {"temperature": temperature, "sampling_seed": 1, "num_logprobs": 5, "max_generate_length": 1,
                    "requests": [user("same prompt")]}
        return [(c.token_id, round(c.logprob, 5)) for c in run(llm, document)[0].logprobs[0]]

    assert first_step(0.2) == first_step(1.0) == first_step(1.7)


def test_logit_bias_forces_a_token_and_a_request_map_overrides_the_global_one(llm):
    tok = llm.get_tokenizer()
    forced = tok.encode("a")[0]
    warnings: list[str] = []
    results = run(llm, {"logit_bias": {str(forced): 100, "100000": 5}, "sampling_seed": 4, "max_generate_length": 6,
                        "requests": [user("one"), user("two"), {**user("three"), "logit_bias": {"100000": 1}}]},
                  warnings)
    assert results[0].output_text == results[1].output_text == "a" * 6
    assert results[2].output_text != "a" * 6
    assert warnings == ["logit_bias token id 100000 is outside the vocabulary (512 tokens); ignored"]


def test_cache_lookup_bypass_reports_no_cached_tokens_and_use_cache_reuses_a_prefix(llm):
    prefix = "A shared system prompt that is long enough to fill several KV pages of sixteen tokens each. "

    def cached(policy: str, tag: str) -> list[int]:
        document = {"context_cache_lookup_policy": policy, "max_generate_length": 2, "apply_chat_template": False,
                    "requests": [user(f"{tag} {prefix}one"), user(f"{tag} {prefix}two")]}
        return [r.cached_tokens for r in run(llm, document)]

    assert cached("bypass", "bypass") == [0, 0]
    first, second = cached("use_cache", "reuse")
    assert first == 0 and second >= 32


def test_cache_policies_reach_the_engine_request(llm):
    def engine_request(**fields):
        batch = parse_batch({**fields, "requests": [user("policy")]})
        return _Preparer(llm, batch, None)(batch.requests[0])

    default = engine_request()
    assert (default.lookup_prefix_cache, default.commit_prefix_cache, default.commit_generated) == (True, True, True)
    bypass = engine_request(context_cache_lookup_policy="bypass", context_cache_commit_policy="prefill_state_only")
    assert (bypass.lookup_prefix_cache, bypass.commit_prefix_cache, bypass.commit_generated) == (False, False, False)
    assert default.thinking is False and default.params.max_tokens == 256 - len(default.prompt_token_ids)
    assert (default.params.temperature, default.params.top_p, default.params.top_k) == (1.0, 0.8, 50)


def test_unsupported_content_fails_only_its_own_request(llm):
    results = run(llm, {"max_generate_length": 3, "requests": [
        user("fine"),
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "/a.wav"}]}]},
        {**user("guided"), "guided_decoding": {"regex": "[ab"}},
        user("also fine"),
    ]})
    assert [r.error is None for r in results] == [True, False, False, True]
    assert results[1].error.startswith("audio content is not supported in this build")
    assert results[2].error.startswith("requests[2].guided_decoding.regex: invalid regex")
    # unseeded sampling may hit end-of-sequence early: the point is that both ran
    assert 0 < results[0].generated_tokens <= 3 and 0 < results[3].generated_tokens <= 3


def test_lora_requests_fail_alone_without_engine_support_or_when_loading_fails(llm, monkeypatch):
    document = {"max_generate_length": 2, "available_lora_weights": {"fr": "/adapters/fr"},
                "requests": [{**user("bonjour"), "lora_name": "fr"}, user("hello")]}
    monkeypatch.setattr(runner_mod, "engine_supports_lora", lambda: False)
    results = run(llm, document)
    assert results[0].error == "LoRA is not available in this build" and results[1].error is None

    def broken(llm, available):
        assert available == {"fr": "/adapters/fr"}
        raise OSError("no such adapter file")

    monkeypatch.setattr(runner_mod, "engine_supports_lora", lambda: True)
    monkeypatch.setattr(runner_mod, "apply_lora", broken)
    results = run(llm, document)
    assert results[0].error == 'available_lora_weights["fr"]: cannot load the adapter: no such adapter file'
    assert results[1].error is None


def test_a_prompt_longer_than_the_context_fails_alone(llm):
    results = run(llm, {"apply_chat_template": False, "max_generate_length": 2,
                        "requests": [user("word " * 400), user("short")]})
    assert results[0].finish_reason == "error" and "context" in results[0].error
    assert results[1].error is None and results[1].generated_tokens == 2


# -- output file ---------------------------------------------------------------------------------
def test_atomic_write_replaces_whole_files_and_leaves_the_old_one_on_failure(tmp_path):
    target = tmp_path / "results.json"
    write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})  # fails halfway through serialising
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
