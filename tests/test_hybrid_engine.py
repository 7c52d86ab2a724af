"""The hybrid families through the whole engine: greedy output equals transformers `generate`
token for token under continuous batching, and state slots come back on every exit path."""

from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.request import EngineRequest
from ninfer.tiny.make import make_tiny

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far away, there lived",
    "A",
]
MAX_NEW = 10
#: plain greedy: Qwen3.5's presets add a presence penalty, which transformers' generate lacks
GREEDY = dict(temperature=0, presence_penalty=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param, seed=0)


def _llm(path) -> LLM:
    # fewer slots than prompts: admission waits for a free slot; chunks of 5 cross pages of 4
    return LLM(str(path), dtype="fp32", device="cpu", max_concurrency=3, prefill_chunk=5, block_size=4)


def _reference(path, token_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones(1, len(ids)),
                eos_token_id=None,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def test_greedy_concurrent_generation_equals_transformers(tiny):
    llm = _llm(tiny)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, **GREEDY)
    results = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    for got, want in zip(results, _reference(tiny, ids)):
        assert got.outputs[0].token_ids == want
    assert len({tuple(r.outputs[0].token_ids) for r in results}) == len(PROMPTS)
    engine = llm.engine
    assert engine.scheduler.state_slots.num_used == 0 and engine.block_manager.num_used_blocks == 0


def test_repeats_reuse_a_snapshot_and_are_identical(tiny):
    llm = _llm(tiny)
    prompt = llm.get_tokenizer().encode(PROMPTS[3] * 2)
    params = SamplingParams(max_tokens=6, **GREEDY)
    first, second = llm.generate([{"prompt_token_ids": prompt}] * 2, params)
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == again.outputs[0].token_ids
    # the deepest reusable page boundary before the last prompt token has a snapshot
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    off = LLM(str(tiny), dtype="fp32", device="cpu", block_size=4, no_prefix_reuse=True)
    assert off.engine.block_manager.enable_prefix_reuse is False
    assert off.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_slots_come_back_on_abort_and_on_error(tiny, monkeypatch):
    llm = _llm(tiny)
    engine = llm.engine
    slots = engine.scheduler.state_slots
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    for i in range(4):
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8)))
    engine.step()
    assert slots.num_used == 3  # three admitted, the fourth waits for a slot
    running = list(engine.scheduler.running)
    assert sorted(s.state_slot for s in running) == [0, 1, 2]
    engine.abort_request("r0")
    assert slots.num_used == 2 and running[0].state_slot is None
    engine.step()  # the waiting request takes the freed slot
    assert slots.num_used == 3

    def broken(*args, **kwargs):
        raise RuntimeError("model step failed")

    failed = {seq.request_id: seq for seq in engine.scheduler.running}
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "launch", broken)
        events = engine.step()
    errored = {e.request_id for e in events if e.finish_reason == "error"}
    assert errored and all(failed[r].state_slot is None for r in errored)
    assert slots.num_used == engine.scheduler.num_running == 3 - len(errored)
    while engine.has_unfinished():  # the rest (if any) finish normally and return theirs
        engine.step()
    assert slots.num_used == 0
