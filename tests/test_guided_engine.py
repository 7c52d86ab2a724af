"""Guided decoding inside the engine: refusals, length limits, thinking, batch independence."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer_plugins.reasoning.qwen3 import QWEN3
from ninfer.engine.guided_masks import GuidedMasks
from ninfer.engine.guided_state import GuidedState, Phase
from ninfer.engine.request import EngineRequest
from ninfer.errors import InvalidRequestError, UnsupportedFeatureError
from ninfer.frontend.thinking import thinking_budget
from ninfer.guided.spec import GuideSpec

PARSER = QWEN3
ANSWER = r"[a-z]{3,8}"


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=256, max_concurrency=8)


def run_engine(llm, requests: list[EngineRequest]) -> dict[str, dict]:
    """Step the engine until done: per request id, its token ids, text and finish."""
    for r in requests:
        llm.engine.add_request(r)
    out = {r.request_id: {"ids": [], "text": "", "finish": None, "error": None} for r in requests}
    while llm.engine.has_unfinished():
        for ev in llm.engine.step():
            o = out[ev.request_id]
            o["ids"] += ev.token_ids
            o["text"] += ev.text
            if ev.finished:
                o["finish"], o["error"] = ev.finish_reason, ev.error
    return out


@pytest.mark.parametrize("spec, fragment", [
    (GuideSpec("regex", "[a-z", param="response_format.pattern"), "invalid regex"),
    (GuideSpec("json_schema", {"type": "wat"}, param="response_format.json_schema.schema"), "invalid json schema"),
    (GuideSpec("json_schema", {"type": "string", "format": "no-such-format"}, param="guided_decoding.json_schema"),
     "invalid json schema"),
    (GuideSpec("ebnf", 'root ::= "a" missing', param="requests[1].guided_decoding.ebnf"), "invalid grammar"),
    (GuideSpec("ebnf", 'root ::= ("a"', param="guided_grammar"), "invalid grammar"),
    (GuideSpec("lark", "start: nowhere", param="tools[0]"), "invalid grammar"),
    (GuideSpec("choice", [], param="guided_choice"), "non-empty array"),
    (GuideSpec("json_schema", "not an object", param="x.json_schema"), "JSON Schema object"),
])
def test_a_bad_guide_is_refused_before_anything_runs(llm, spec, fragment):
    fine = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["ok", "bad"], [fine, SamplingParams(max_tokens=2, guided=spec)])
    assert err.value.param == spec.param and err.value.status == 400
    assert fragment in err.value.message, err.value.message
    assert not llm.engine.has_unfinished()  # the request queued before it was withdrawn
    assert llm.generate("still serving", fine)[0].outputs[0].finish_reason == "length"


def test_structural_tag_shape_errors_name_the_subfield(llm):
    tag = {"triggers": ["<tool_call>"], "structures": [{"begin": "<tool>", "schema": {}, "end": ""}]}
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("x", SamplingParams(guided=GuideSpec("structural_tag", tag, param="st")))
    assert err.value.param == "st.structures[0].begin"
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("x", SamplingParams(guided=GuideSpec("structural_tag", {"structures": []}, param="st")))
    assert err.value.param == "st.triggers"


def test_a_guide_that_cannot_finish_ends_with_length(llm):
    spec = GuideSpec("regex", "[a-z]{40}")
    outs = llm.generate(["go"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=5, guided=spec)
                                     for s in range(4)], thinking=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        assert re.fullmatch("[a-z]{1,39}", c.text), c.text  # a valid prefix of the guide


def test_a_finished_guide_stops_the_request(llm):
    out = llm.generate("go", SamplingParams(temperature=1.0, seed=3, max_tokens=50,
                                            guided=GuideSpec("choice", ["alpha", "beta"])), thinking=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text in ("alpha", "beta")
    assert len(c.token_ids) < 50


def test_unguided_requests_are_unaffected_by_guided_neighbours(llm):
    prompts = ["one two three", "the quick brown fox", "zzz"]
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, thinking=False)]
    guided = [SamplingParams(temperature=t, seed=7, max_tokens=12, guided=GuideSpec("regex", ANSWER))
              for t in (0.0, 1.0, 1.0)]
    mixed = llm.generate(prompts + prompts, greedy + guided, thinking=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        assert re.fullmatch(ANSWER, o.outputs[0].text), o.outputs[0].text


def test_guided_greedy_takes_the_best_allowed_token(llm):
    tok = llm.get_tokenizer()
    plain = llm.generate("abc", SamplingParams(temperature=0, max_tokens=1, logprobs=20), thinking=False)[0]
    guided = llm.generate("abc", SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                                guided=GuideSpec("regex", "[a-z]+")), thinking=False)[0]
    top = plain.outputs[0].logprobs[0].top  # the model's ranking (guides do not change logprobs)
    best_allowed = next(t.token_id for t in top if re.fullmatch("[a-z]+", tok.decode([t.token_id])))
    assert guided.outputs[0].token_ids == [best_allowed]
    assert [t.token_id for t in guided.outputs[0].logprobs[0].top] == [t.token_id for t in top]


# -- thinking ---------------------------------------------------------------------------------
def chat_prompt(tok, open_reasoning: bool) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "think, then answer"}], enable_thinking=True)
    return tok.encode(text + ("<think>\n" if open_reasoning else ""))


def split_answer(text: str) -> tuple[str, str]:
    reasoning, marker, answer = text.partition("</think>")
    assert marker, text
    assert answer.startswith("\n\n"), text  # the chat format's separator comes before the answer
    return reasoning, answer[2:]


def test_reasoning_is_free_and_the_answer_is_guided_after_a_budget_close(llm):
    tok = llm.get_tokenizer()
    prompt = chat_prompt(tok, open_reasoning=True)
    requests = []
    for seed in range(6):
        budget = thinking_budget(tok, PARSER, 12, 80, open_at_start=True)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, guided=GuideSpec("regex", ANSWER))
        requests.append(EngineRequest(f"t{seed}", prompt, params, thinking=True, thinking_budget=budget))
    results = run_engine(llm, requests)
    reasonings = []
    for r in results.values():
        assert r["finish"] == "stop", r
        reasoning, answer = split_answer(r["text"])
        assert re.fullmatch(ANSWER, answer), answer
        reasonings.append(reasoning)
    # the reasoning was not held to the guide: the random model wrote other characters there
    assert any(re.search(r"[^a-z]", x.split("Considering")[0]) for x in reasonings)


def test_a_natural_close_gets_the_separator_before_the_guided_answer(llm):
    tok = llm.get_tokenizer()
    end_id = tok.token_to_id("</think>")
    # the first reasoning token is the close marker; the bias cannot reach the answer,
    # where the guide forbids that token
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, logit_bias={end_id: 100.0},
                            guided=GuideSpec("regex", ANSWER))
    r = run_engine(llm, [EngineRequest("n", chat_prompt(tok, open_reasoning=True), params, thinking=True)])["n"]
    sep = tok.encode("\n\n")
    assert r["ids"][: 1 + len(sep)] == [end_id, *sep], r
    reasoning, answer = split_answer(r["text"])
    assert reasoning == "" and re.fullmatch(ANSWER, answer) and r["finish"] == "stop"


def test_with_thinking_on_the_model_may_open_reasoning_first(llm):
    tok = llm.get_tokenizer()
    start_id, end_id = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    bias = {start_id: 50.0, end_id: 100.0}  # open first (closing is not allowed yet), then close
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=40, logit_bias=bias, guided=GuideSpec("regex", ANSWER))
    prompt = chat_prompt(tok, open_reasoning=False)
    on = run_engine(llm, [EngineRequest("on", prompt, params, thinking=True)])["on"]
    assert on["ids"][:2] == [start_id, end_id]
    head = "<think></think>\n\n"
    assert on["text"].startswith(head) and re.fullmatch(ANSWER, on["text"][len(head):])
    # with thinking off the guide holds from the first token: the opener is never allowed
    off = run_engine(llm, [EngineRequest("off", prompt, params, thinking=False)])["off"]
    assert start_id not in off["ids"] and re.fullmatch(ANSWER, off["text"]), off


# -- stopping while a guide is pending ----------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}


def test_end_of_sequence_inside_reasoning_never_ends_a_guided_request(llm):
    """Issue #20: an end-of-sequence sampled while thinking ended the request with "stop"
    and no answer. Every request now ends with a valid answer, or runs out of tokens."""
    conversation = [{"role": "user", "content": "What is the weather in Paris this week?"}]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32, guided=GuideSpec("json_schema", CITY))
              for seed in range(12)]
    outs = llm.chat([conversation] * len(params), params, chat_template_kwargs={"enable_thinking": True})
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "stop", c
        _, answer = split_answer(c.text)
        assert set(json.loads(answer)) == {"city", "days"}, c.text


def test_reasoning_cannot_stop_before_the_guided_answer(llm):
    tok = llm.get_tokenizer()
    prompt = chat_prompt(tok, open_reasoning=True)
    # the model wants to end at once; it may do so only once the answer is complete
    bias = {e: 100.0 for e in tok.eos_token_ids}
    requests = []
    for seed in range(3):
        budget = thinking_budget(tok, PARSER, 6, 80, open_at_start=True)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, logit_bias=bias,
                                guided=GuideSpec("regex", ANSWER))
        requests.append(EngineRequest(f"r{seed}", prompt, params, thinking=True, thinking_budget=budget))
    for r in run_engine(llm, requests).values():
        assert r["finish"] == "stop", r
        reasoning, answer = split_answer(r["text"])
        assert not set(r["ids"][:6]) & set(tok.eos_token_ids)  # the budget, not an EOS, closed reasoning
        assert re.fullmatch(ANSWER, answer) and r["ids"][-1] in tok.eos_token_ids, r  # EOS once allowed


def test_a_request_s_stop_token_waits_until_its_guide_can_end(llm):
    tok = llm.get_tokenizer()
    stop = tok.encode("a")[0]  # a token the guide allows from the start
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], logit_bias={stop: 100.0},
                            guided=GuideSpec("regex", ANSWER))
    c = llm.generate("go", params, thinking=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop, c
    assert re.fullmatch(ANSWER, c.text) and c.token_ids[:-1].count(stop) == 0, c


def test_masks_hold_stops_until_the_guide_accepts(llm):
    guided = llm.engine.guided
    masks = GuidedMasks(guided.compiler, llm.engine.vocab_size, torch.device("cpu"))
    state = GuidedState(guided.compiler.matcher(GuideSpec("regex", "ab")), Phase.ACTIVE, None, guided.end_ids)
    masks.track(1, state)
    assert masks.masks([1]).hold_stops == {0}
    tok = llm.get_tokenizer()
    for t in tok.encode("ab"):
        state.on_token(t)
    assert masks.masks([1]).hold_stops == frozenset()  # the guide may end: EOS is allowed again


def test_a_rejected_token_fails_only_its_own_request(llm):
    tok = llm.get_tokenizer()
    prompt = chat_prompt(tok, open_reasoning=False)
    # The budget believes reasoning is open while the guide (thinking off) is already in
    # force, so the forced close text reaches the matcher, which must refuse it.
    budget = thinking_budget(tok, PARSER, 2, 80, open_at_start=True)
    bad = EngineRequest("bad", prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=80,
                                                      guided=GuideSpec("regex", "[a-z]+")),
                        thinking=False, thinking_budget=budget)
    good = EngineRequest("good", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    results = run_engine(llm, [bad, good])
    assert results["bad"]["finish"] == "error"
    assert results["bad"]["error"].code == "guided_decoding_failed"
    assert "rejected token" in results["bad"]["error"].message
    assert results["good"]["finish"] == "length" and len(results["good"]["ids"]) == 6


def test_guided_decoding_turned_off_refuses_guided_requests(tiny_qwen3):
    off = LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=64, guided_backend="none")
    with pytest.raises(UnsupportedFeatureError) as err:
        off.generate("x", SamplingParams(guided=GuideSpec("regex", "a", param="guided_regex")))
    assert err.value.param == "guided_regex" and err.value.status == 400
    assert off.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
