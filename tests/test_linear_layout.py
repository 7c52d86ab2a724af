"""Column-major Linear weights (the CUDA decode layout) compute the same model."""

from __future__ import annotations

import torch

from ninfer import LLM, SamplingParams
from ninfer_plugins.models.layers import Linear, store_linears_column_major


def test_column_major_weights_keep_shapes_values_and_outputs(one_thread):
    llm = LLM("tiny:qwen3", device="cpu", dtype="fp32", max_context=64, kv_capacity=256)
    model = llm.engine.model
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    before = llm.generate(["The quick brown fox"], params)[0].outputs[0].token_ids
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = store_linears_column_major(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    tied = [m for m in linears if m.weight is model.model.embed_tokens.weight]
    assert moved == len(linears) - len(tied) > 0
    for m in linears:
        # a weight the embedding gathers by rows is left alone
        assert m.weight.is_contiguous() if m in tied else m.weight.t().is_contiguous()
    for name, p in model.named_parameters():
        assert p.shape == weights[name].shape and torch.equal(p, weights[name])
    after = llm.generate(["The quick brown fox"], params)[0].outputs[0].token_ids
    assert after == before
