"""Prompt log probabilities equal transformers' log_softmax over the prompt's forward pass."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.errors import InvalidRequestError

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, then naps in the sun",
    "def add(a, b):\n    return a + b",
    "A",
]
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    """Per prompt: [T, vocab] float32 log probabilities from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run


def _check(result, ref: torch.Tensor) -> None:
    ids = result.prompt_token_ids
    plps = result.prompt_logprobs
    assert plps is not None and len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        pos = plps[p]
        assert pos.token_id == ids[p]
        assert pos.logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        want_lps, want_ids = ref[p - 1].topk(TOP)
        assert [t.token_id for t in pos.top] == want_ids.tolist()
        assert [t.logprob for t in pos.top] == pytest.approx(want_lps.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [4, 1024])
def test_prompt_logprobs_match_transformers(tiny_qwen3, reference, chunk):
    # chunk 4 puts chunk boundaries inside every longer prompt; the prompts share a batch
    llm = LLM(str(tiny_qwen3), dtype="fp32", device="cpu", max_concurrency=4, prefill_chunk=chunk, block_size=4)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 2 * chunk or chunk > 100
    params = [
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=TOP),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, logprobs=1),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
    ]
    results = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    for result, prompt_ids in zip(results, ids):
        _check(result, reference(prompt_ids))
    assert results[0].outputs[0].token_ids == [] and len(results[1].outputs[0].token_ids) == 3
    assert results[2].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    assert llm.engine.block_manager.num_used_blocks == 0


def test_prompt_logprobs_ignore_the_prefix_cache_and_are_off_by_default(tiny_qwen3, reference):
    llm = LLM(str(tiny_qwen3), dtype="fp32", device="cpu", max_concurrency=2, prefill_chunk=8, block_size=4)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.num_cached_tokens > 0  # the prompt's pages are in the prefix cache...
    scored = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=TOP))[0]
    assert scored.num_cached_tokens == 0  # ...but scoring computes every position anyway
    _check(scored, reference(ids))


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_range_is_validated(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=value).validate()
    assert e.value.param == "prompt_logprobs"
