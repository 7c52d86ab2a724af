"""Engine behaviour through the Python API: reuse, pages, stops, errors, seeds."""

from __future__ import annotations

import pytest

from ninfer import LLM, SamplingParams
from ninfer.errors import ContextLengthExceededError, InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="fp32", device="cpu", max_concurrency=4, prefill_chunk=16, block_size=4,
               max_context=256, kv_capacity=2048)


def test_prefix_reuse_computes_only_the_suffix(llm):
    tok = llm.get_tokenizer()
    shared = tok.encode("A shared system prompt that is long enough to fill several pages of the cache. " * 2)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate({"prompt_token_ids": shared + tok.encode(" one")}, greedy)[0]
    second = llm.generate({"prompt_token_ids": shared + tok.encode(" two")}, greedy)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(shared) - 4
    assert second.num_cached_tokens % 4 == 0


def test_reuse_does_not_change_output(llm, tiny_qwen3):
    tok = llm.get_tokenizer()
    prompt = tok.encode("Reuse must be exact: the same prompt gives the same greedy answer.")
    greedy = SamplingParams(temperature=0, max_tokens=10)
    a = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    b = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert b.num_cached_tokens > 0
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    fresh = LLM(str(tiny_qwen3), dtype="fp32", device="cpu", block_size=4, max_context=256, no_prefix_reuse=True)
    c = fresh.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert c.num_cached_tokens == 0
    assert c.outputs[0].token_ids == a.outputs[0].token_ids


def test_pages_return_after_finish_and_abort(llm):
    bm = llm.engine.block_manager
    engine = llm.engine
    from ninfer.engine.request import EngineRequest

    engine.add_request(EngineRequest("x", llm.get_tokenizer().encode("abort me please"), SamplingParams(max_tokens=50)))
    engine.step()
    assert bm.num_used_blocks > 0
    event = engine.abort_request("x")
    assert event.finished and event.finish_reason == "abort"
    assert bm.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_max_tokens_and_length_finish(llm):
    out = llm.generate("count", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_string_is_excluded_and_never_leaks(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("The weather today", greedy)[0].outputs[0].text
    assert len(full) > 4
    stop = full[2:4]
    out = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("seeded", params)[0].outputs[0].token_ids
    crowd = llm.generate(["other one", "seeded", "and another longer prompt here"],
                         [SamplingParams(temperature=1.0, seed=7, max_tokens=12), params,
                          SamplingParams(temperature=0.5, max_tokens=5)])
    assert crowd[1].outputs[0].token_ids == alone


def test_logprobs_shape(llm):
    c = llm.generate("logprobs", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert pos.token_id == tok and len(pos.top) == 3
        assert pos.top[0].token_id == tok  # greedy picks the most likely token
        assert pos.top[0].logprob >= pos.top[1].logprob >= pos.top[2].logprob
        assert isinstance(pos.top[0].bytes, list)


@pytest.mark.parametrize(
    "params, exc",
    [
        (SamplingParams(max_tokens=10_000), ContextLengthExceededError),
        (SamplingParams(temperature=float("nan")), InvalidRequestError),
        (SamplingParams(logit_bias={10**9: 1.0}), InvalidRequestError),
        (SamplingParams(logit_bias={1: 500.0}), InvalidRequestError),
        (SamplingParams(top_p=0.0), InvalidRequestError),
    ],
)
def test_bad_input_is_a_typed_error_and_engine_keeps_serving(llm, params, exc):
    with pytest.raises(exc):
        llm.generate("bad", params)
    assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_prompt_longer_than_context(llm):
    with pytest.raises(ContextLengthExceededError):
        llm.generate({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=None))


def test_chat_renders_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       enable_thinking=True)
    assert out.prompt_token_ids == tok.encode(rendered)


def test_chat_takes_the_servers_template_options_and_names_the_unknown_ones(llm):
    """LLM.chat renders through the front doors' pipeline: same options, same refusals."""
    from ninfer.errors import InvalidRequestError

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    tok = llm.get_tokenizer()
    off = llm.chat(conv[:1], SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt.endswith("<think>\n\n</think>\n\n")
    history = llm.chat(conv, SamplingParams(max_tokens=1), add_generation_prompt=False)[0]
    prefill = llm.chat(conv, SamplingParams(max_tokens=1), continue_final_message=True)[0]
    assert not history.prompt.endswith("assistant\n") and prefill.prompt.endswith("Hel")
    assert prefill.prompt_token_ids == tok.encode(prefill.prompt)
    with pytest.raises(ValueError, match="enable_thinkng"):
        llm.chat(conv[:1], chat_template_kwargs={"enable_thinkng": True})
    with pytest.raises(InvalidRequestError, match="reasoning_effort"):
        llm.chat(conv[:1], chat_template_kwargs={"reasoning_effort": "extreme"})


def test_n_samples(llm):
    out = llm.generate("n", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # sample i is the request seeded with seed + i, alone
    second = llm.generate("n", SamplingParams(temperature=1.0, seed=6, max_tokens=6, ignore_eos=True))[0]
    assert second.outputs[0].token_ids == out.outputs[1].token_ids


def test_n_samples_differ_under_a_process_seed(tiny_qwen3):
    seeded = LLM(str(tiny_qwen3), dtype="float32", seed=21)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    first = [c.token_ids for c in seeded.generate("n", params)[0].outputs]
    assert len({tuple(t) for t in first}) > 1
    assert [c.token_ids for c in seeded.generate("n", params)[0].outputs] == first
