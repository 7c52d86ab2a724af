"""The output-limit fit in ``Pipeline.plan``: refusals name the request's own fields, a
ceiling (the batch format's max_generate_length) is shortened to the context and the KV
pool, and 0 stays prompt-only. The server-level view (the request log) is in
tests/test_request_log_errors.py; the engine's own guard for direct callers is at the end.
"""

from __future__ import annotations

from importlib import resources

import pytest
from _hosts import TokenizerHost

from ninfer.errors import ContextLengthExceededError
from ninfer.frontend.pipeline import Pipeline
from ninfer.frontend.pipeline_request import GenerateRequest, TextPrompt
from ninfer.sampling_params import SamplingParams
from ninfer.tiny.tokenizer_files import build_tokenizer
from ninfer.tokenizer import Tokenizer

CONTEXT, KV = 64, 48
TEMPLATE = resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    tokenizer = Tokenizer(build_tokenizer(), templates={"default": TEMPLATE})
    return Pipeline(TokenizerHost(tokenizer, max_model_len=CONTEXT, kv_capacity_tokens=KV))


def request(prompt_tokens: int, max_tokens, **kw) -> GenerateRequest:
    return GenerateRequest([TextPrompt(token_ids=[5] * prompt_tokens)], SamplingParams(max_tokens=max_tokens), **kw)


def refusal(pipeline: Pipeline, req: GenerateRequest) -> ContextLengthExceededError:
    with pytest.raises(ContextLengthExceededError) as e:
        pipeline.plan(req, "r")
    return e.value


@pytest.mark.parametrize("field", ["max_output_tokens", "max_completion_tokens", "max_tokens"])
def test_an_output_limit_over_the_context_is_refused_naming_the_field_the_request_used(pipeline, field):
    error = refusal(pipeline, request(20, 50, max_tokens_param=field))
    assert error.param == field and f"plus {field} (50)" in error.message and "context of 64" in error.message


def test_an_output_limit_over_the_kv_pool_is_refused_in_preparation_too(pipeline):
    error = refusal(pipeline, request(20, 40, max_tokens_param="max_output_tokens"))  # 60 <= 64, but > 48
    assert error.param == "max_output_tokens" and "KV capacity of 48" in error.message
    assert pipeline.plan(request(20, 28), "r").requests[0].params.max_tokens == 28  # exactly full


def test_a_prompt_that_leaves_no_room_for_the_default_names_the_prompt_field(pipeline):
    error = refusal(pipeline, request(KV, None, prompt_param="input"))
    assert error.param == "input" and "no room for output" in error.message
    assert refusal(pipeline, request(KV + 1, None, prompt_param="input")).param == "input"  # beyond the pool
    (engine_request,) = pipeline.plan(request(KV - 1, None), "r").requests
    assert engine_request.params.max_tokens is None  # the engine applies the default within the room
    # max_tokens 0 only reads the prompt, which needs no room
    assert pipeline.plan(request(KV, 0), "r").requests[0].params.max_tokens == 0


def test_a_ceiling_is_shortened_to_the_kv_pool_and_zero_stays_zero(pipeline):
    batch = {"fit_max_tokens": True, "prompt_param": "requests[3].messages", "max_tokens_param": "max_generate_length"}
    assert pipeline.plan(request(18, 256, **batch), "r").requests[0].params.max_tokens == KV - 18
    assert pipeline.plan(request(18, 5, **batch), "r").requests[0].params.max_tokens == 5
    assert pipeline.plan(request(18, 0, **batch), "r").requests[0].params.max_tokens == 0
    error = refusal(pipeline, request(KV, 5, **batch))  # nothing could be generated: the prompt's fault
    assert error.param == "requests[3].messages" and "no room for output" in error.message


def test_the_engine_fits_its_default_to_a_kv_pool_smaller_than_the_context(tiny_qwen3):
    """A direct engine caller (no plan) with no limit: the default gives way to the pool."""
    from ninfer import LLM
    from ninfer.engine.request import EngineRequest

    llm = LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=256, kv_capacity=64, default_max_tokens=200)
    prompt = llm.get_tokenizer().encode("count with me")
    llm.engine.add_request(EngineRequest("direct", prompt, SamplingParams(max_tokens=None, ignore_eos=True)))
    finals = []
    while llm.engine.has_unfinished():
        finals += [e for e in llm.engine.step() if e.finished]
    (final,) = finals
    assert final.error is None and final.finish_reason == "length"
    assert final.num_prompt_tokens + final.num_output_tokens == 64
