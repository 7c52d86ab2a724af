"""The engine closes reasoning itself at the thinking budget and keeps generating."""

from __future__ import annotations

import pytest

from ninfer import LLM, SamplingParams
from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.engine.request import EngineRequest
from ninfer.errors import InvalidRequestError
from ninfer.frontend.thinking import thinking_budget

PARSER = QWEN3


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="fp32", device="cpu", block_size=4, max_context=512, prefill_chunk=16)


def _run(llm, budget, max_tokens=80):
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "think"}], enable_thinking=True))
    spec = thinking_budget(tok, PARSER, budget, max_tokens, open_at_start=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.add_request(EngineRequest("b", prompt, params, thinking_budget=spec))
    ids, text = [], ""
    while llm.engine.has_unfinished():
        for ev in llm.engine.step():
            ids += ev.token_ids
            text += ev.text
    return ids, text, spec


def test_budget_inserts_the_close_and_generation_continues(llm):
    ids, text, spec = _run(llm, budget=5)
    close = spec.close_ids
    # five reasoning tokens (the model never closes on its own here), then the close
    assert spec.end_id not in ids[:5]
    assert ids[5 : 5 + len(close)] == close
    assert len(ids) == 80 and len(ids) > 5 + len(close)  # the model continued after the close
    assert text.count("</think>") == 1


def test_no_budget_means_no_insertion(llm):
    tok = llm.get_tokenizer()
    ids, _, _ = _run(llm, budget=1000)
    close = tok.encode(PARSER.budget_close)
    assert ids[5 : 5 + len(close)] != close


def test_capacity_too_small_for_the_close_is_rejected(llm):
    tok = llm.get_tokenizer()
    n = len(tok.encode(PARSER.budget_close))
    with pytest.raises(InvalidRequestError) as err:
        thinking_budget(tok, PARSER, 10, 10 + n, open_at_start=True)
    assert err.value.code == "thinking_budget_capacity_insufficient"
    assert thinking_budget(tok, PARSER, 10, 10 + n + 1, open_at_start=True) is not None
    assert thinking_budget(tok, PARSER, 10, 5, open_at_start=True) is not None  # cap never reached


def test_budget_rows_run_ahead_until_the_close_is_near(tiny_qwen3):
    """A decode step launched ahead samples after a token the host has not counted; while
    that token cannot reach the budget the row runs ahead, and the close lands where the
    one-step-at-a-time engine puts it."""
    def run(ahead: bool):
        llm = LLM(str(tiny_qwen3), dtype="fp32", device="cpu", block_size=4, max_context=512, prefill_chunk=16,
                  decode_ahead_on_cpu=ahead)
        ids, _, spec = _run(llm, budget=10, max_tokens=120)
        return ids, spec, llm.engine.stats.total_steps_ahead

    (sync, spec, _), (ahead, _, steps_ahead) = run(False), run(True)
    assert sync[10 : 10 + len(spec.close_ids)] == spec.close_ids  # the close was forced, not the model's own
    assert ahead == sync
    assert steps_ahead > 50  # before the close and after it
