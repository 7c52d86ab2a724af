"""Greedy continuous-batched output equals transformers `generate`, token for token."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return",
    '{"name": "ninfer", "kind":',
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Über Straßen und Brücken",
    "A",
    "Paged attention keeps the KV cache in fixed-size blocks so that many requests",
]
MAX_NEW = 12


def _reference(model_dir, token_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones(1, len(ids))
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("chunk", [5, 1024])
def test_greedy_batch_equals_transformers(tiny_model, chunk):
    llm = LLM(str(tiny_model), dtype="fp32", device="cpu", max_concurrency=8, prefill_chunk=chunk, block_size=4)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    results = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    expected = _reference(tiny_model, ids)
    for got, want in zip(results, expected):
        assert got.outputs[0].token_ids == want
    assert len({tuple(r.outputs[0].token_ids) for r in results}) > 1, "tiny model output is degenerate"
    # every page is back in the pool
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0
