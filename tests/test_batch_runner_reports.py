"""``ninfer-run`` reports what it did instead of quietly changing it: the sampling it used
(model presets stay out), each broken LoRA adapter, a capped batch_size, the input field
behind a request's error, values the parser would drop, and flags it does not use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ninfer.batch import BatchInputError, parse_batch, parse_batch_json
from ninfer.batch.output import summary_json
from ninfer.batch.runner import _error_text, _Preparer, run_batch
from ninfer.cli.run import build_parser
from ninfer.engine.defaults import resolve_sampling
from ninfer.errors import InvalidRequestError
from ninfer.model.family import SamplingDefaults, SamplingPresets
from ninfer.sampling_schema import SAMPLING

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batch.md"
NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
# a preset as unlike the neutral one as it gets (Qwen3.5's cards set presence_penalty 1.5)
LOUD = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.1, presence_penalty=1.5,
                        frequency_penalty=0.5, repetition_penalty=1.3)


def user(text) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=256, max_concurrency=4)


def run(llm, document: dict, warnings: list[str] | None = None):
    return run_batch(llm, parse_batch(document), warn=(warnings if warnings is not None else []).append)


# -- D2: sampling ------------------------------------------------------------------------------
def test_family_presets_do_not_reach_batch_sampling(llm, monkeypatch):
    document = {"temperature": 0, "max_generate_length": 12, "apply_chat_template": False,
                "requests": [user("the cat sat on the mat and the cat")]}
    plain = run(llm, document)
    monkeypatch.setattr(llm.engine, "presets", SamplingPresets(thinking=LOUD, non_thinking=LOUD))
    batch = parse_batch(document)
    resolved = resolve_sampling(_Preparer(llm, batch)(batch.requests[0]).params, llm.engine.presets, False,
                                llm.engine.config.process_sampling)
    assert {name: getattr(resolved, name) for name in NEUTRAL} == NEUTRAL
    assert (resolved.temperature, resolved.top_p, resolved.top_k) == (0.0, 0.8, 50)  # the format's, not the preset's
    preset = run(llm, document)
    assert preset.results[0].output_text == plain.results[0].output_text  # temperature 0 stays argmax
    assert preset.sampling == {"temperature": 0.0, "top_p": 0.8, "top_k": 50, **NEUTRAL}
    assert summary_json(preset, batch, "m", 0.0)["sampling"] == preset.sampling


def test_process_flags_still_set_the_fields_the_format_has_none_for(tiny_qwen3):
    from ninfer import LLM

    flagged = LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=128, presence_penalty=0.5, top_k=5)
    sampling = run(flagged, {"max_generate_length": 2, "requests": [user("a")]}).sampling
    assert (sampling["presence_penalty"], sampling["top_k"], sampling["min_p"]) == (0.5, 5, 0.0)
    # the file's own top_k beats the flag, as before
    assert run(flagged, {"top_k": 7, "max_generate_length": 2, "requests": [user("a")]}).sampling["top_k"] == 7


# -- D3: LoRA adapters, one at a time ------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(tiny_qwen3, tmp_path_factory) -> Path:
    """A PEFT-layout adapter on layer 0's q_proj, written directly (no peft import needed)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((tiny_qwen3 / "config.json").read_text())
    hidden = config["hidden_size"]
    q_out = config["num_attention_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    path = tmp_path_factory.mktemp("lora-good")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{module}.lora_A.weight": torch.randn(2, hidden), f"{module}.lora_B.weight": torch.randn(q_out, 2)},
              str(path / "adapter_model.safetensors"))
    return path


def test_a_broken_adapter_fails_only_its_requests_and_unused_ones_are_warned_about(llm, adapter, tmp_path):
    document = {"max_generate_length": 2,
                "available_lora_weights": {"bad": str(tmp_path / "missing"), "good": str(adapter),
                                           "spare": str(tmp_path / "also-missing")},
                "requests": [{**user("a"), "lora_name": "good"}, {**user("b"), "lora_name": "bad"}, user("c")]}
    warnings: list[str] = []
    batch_run = run(llm, document, warnings)
    good, bad, plain = batch_run.results
    assert good.error is None and plain.error is None and good.generated_tokens == 2
    assert bad.error.startswith('available_lora_weights["bad"]: cannot load the adapter: ')
    assert len(warnings) == 2 and warnings == batch_run.warnings
    assert warnings[0].startswith('available_lora_weights["bad"]') and "1 request(s) naming it fail" in warnings[0]
    assert warnings[1].startswith('available_lora_weights["spare"]') and "no request names it" in warnings[1]


# -- D4: batch_size over the engine's limit --------------------------------------------------------
def test_a_batch_size_over_the_engine_limit_is_warned_and_reported_as_run(llm):
    document = {"batch_size": 6, "max_generate_length": 1, "requests": [user(str(i)) for i in range(6)]}
    warnings: list[str] = []
    batch_run = run(llm, document, warnings)
    assert warnings == ["batch_size: 6 is more than the engine decodes together (max_concurrency 4); "
                        "4 requests run at a time"]
    summary = summary_json(batch_run, parse_batch(document), "m", 0.0)
    assert summary["batch_size"] == 4 and summary["warnings"] == warnings
    assert run(llm, {**document, "batch_size": 3}).batch_size == 3


# -- D5: errors name the input field --------------------------------------------------------------
def test_request_errors_name_the_input_field(llm):
    results = run(llm, {"apply_chat_template": False, "max_generate_length": 2,
                        "requests": [user("ok"), user(""), user("word " * 300)]}).results
    assert results[0].error is None
    assert results[1].error == "requests[1].messages: the prompt is empty"
    assert results[2].error.startswith("requests[2].messages: ") and "context" in results[2].error
    req = parse_batch({"requests": [user("a")] * 4}).requests[3]
    kv = InvalidRequestError("prompt plus output (274 tokens) exceeds the KV capacity (256 tokens)", param="max_tokens")
    assert _error_text(kv, req, None) == f"max_generate_length: {kv.message}"
    assert _error_text(InvalidRequestError("x", param="lora_name"), req, None) == "requests[3].lora_name: x"
    assert _error_text(ValueError("no field"), req, None) == "no field"


# -- D6: nothing dropped silently while parsing ---------------------------------------------------
def test_duplicate_keys_are_warned_about_with_their_path():
    text = ('{"temperature": 0.2, "temperature": 3.0, "requests": [{"messages": [{"role": "user", "content": "a"}],'
            ' "logit_bias": {"5": 1, "5": 2}}]}')
    batch = parse_batch_json(text)
    assert batch.temperature == 3.0  # the last value, as json.loads (and so vLLM) reads it
    assert batch.warnings == ["temperature: duplicate key; the last value is used",
                              'requests[0].logit_bias["5"]: duplicate key; the last value is used']
    assert parse_batch_json(json.dumps({"requests": [user("a")]})).warnings == []


@pytest.mark.parametrize("document,message", [
    ({"logit_bias": {"12": 5.0, "012": -5.0}, "requests": [user("a")]},
     'logit_bias["012"]: names token 12 again (also given as "12")'),
    ({"requests": [{**user("a"), "guided_decoding": {"json_object": {"type": "array"}}}]},
     "requests[0].guided_decoding.json_object: must be true"),
    ({"requests": [user("a")], "guided_decoding": {"json_object": False}}, "guided_decoding.json_object: must be true"),
])
def test_values_that_would_be_dropped_are_refused(document, message):
    with pytest.raises(BatchInputError) as info:
        parse_batch(document)
    assert any(e.startswith(message) for e in info.value.errors), info.value.errors


def test_colliding_logit_bias_keys_are_refused_for_every_reader():
    problem = SAMPLING["logit_bias"].problem({"7": 1.0, "0007": 2.0})
    assert problem is not None and problem.where == '["0007"]' and "token 7 again" in problem.reason
    assert SAMPLING["logit_bias"].problem({"007": 1.0, "8": 2.0}) is None  # one spelling per token is fine


# -- D8: only the flags the runner uses ----------------------------------------------------------
def test_help_lists_only_options_the_runner_uses_with_its_own_defaults():
    text = " ".join(build_parser().format_help().split())
    for flag in ("--port", "--host", "--api-key", "--cors", "--default-max-tokens", "--tool-parser",
                 "--request-log-jsonl", "--response-store-max-records"):
        assert not re.search(rf"{flag}(?![\w-])", text), flag
    assert "--max-concurrency N requests decoded together (default: the input's batch_size, at most 8)" in text
    assert "--presence-penalty F presence_penalty for every request (default: 0" in text
    assert "(default: model preset)" not in text


@pytest.mark.parametrize("flags", [["--port", "1"], ["--api-key", "k"], ["--no-cors"], ["--default-max-tokens", "9"]])
def test_server_only_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--input", "in.json", "--output", "out.json", "tiny:qwen3", *flags])
    assert info.value.code == 2
    assert f"{flags[0]} is a ninfer-serve option; ninfer-run does not use it" in capsys.readouterr().err


# -- D9: the documented summary keys exist --------------------------------------------------------
def test_docs_output_example_uses_real_summary_keys(llm):
    example = DOCS.read_text(encoding="utf-8").split("## Output", 1)[1].split("```", 2)[1]
    summary_text = re.sub(r"\{[^{}]*\}", "{}", example.split('"summary": {', 1)[1])  # top-level keys only
    documented = re.findall(r'"(\w+)":', summary_text)
    document = {"max_generate_length": 1, "requests": [user("a")]}
    summary = summary_json(run(llm, document), parse_batch(document), "m", 0.0)
    assert documented and set(documented) <= set(summary), set(documented) - set(summary)
