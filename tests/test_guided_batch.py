"""The batch runner's ``guided_decoding``: every mode, escaped JSON values, the top-level
default with per-request overrides, and guides that do not compile."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ninfer.batch import parse_batch
from ninfer.batch.runner import run_batch

NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
TAG = {"triggers": ["<tool_call>"],
       "structures": [{"begin": "<tool_call>\n", "schema": NUMBER, "end": "\n</tool_call>"}]}


def user(text: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], **fields}


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from ninfer import LLM

    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=256, max_concurrency=4)


def test_every_mode_runs_from_an_input_file(llm):
    tool_call = 506  # the tiny tokenizer's <tool_call>: make the model call the tool now and then
    document = {
        "batch_size": 4, "max_generate_length": 48, "temperature": 1.0, "sampling_seed": 11,
        "guided_decoding": {"regex": "[0-9]{3}-[a-z]{2}"},
        "requests": [
            user("default guide"),
            user("escaped choice", guided_decoding={"choice": '["red", "green", "blue"]'}),
            user("inline schema", guided_decoding={"json_schema": NUMBER}),
            user("escaped schema", guided_decoding={"json_schema": json.dumps(NUMBER)}),
            user("grammar", guided_decoding={"ebnf": 'root ::= "id-" [0-9] [0-9]?'}),
            user("tagged", guided_decoding={"structural_tag": json.dumps(TAG)},
                 logit_bias={str(tool_call): 8.0}),
            user("inline choice", guided_decoding={"choice": ["up", "down"]}),
            user("default again", sampling_seed=5),
        ],
    }
    results = run_batch(llm, parse_batch(document), warn=lambda _: None).results
    assert [r.error for r in results] == [None] * 8
    text = [r.output_text for r in results]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text[0]) and re.fullmatch("[0-9]{3}-[a-z]{2}", text[7])
    assert text[1] in ("red", "green", "blue") and text[6] in ("up", "down")
    for i in (2, 3):
        jsonschema.validate(json.loads(text[i]), NUMBER)
    assert re.fullmatch("id-[0-9]{1,2}", text[4])
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text[5], flags=re.S)
    assert len(calls) >= 2
    for call in calls:
        jsonschema.validate(json.loads(call), NUMBER)
    assert [r.finish_reason for r in results if r.index != 5] == ["end-of-sequence"] * 7


def test_a_guide_that_does_not_compile_fails_its_requests_with_the_json_path(llm):
    document = {
        "max_generate_length": 8, "batch_size": 2, "temperature": 0,
        "guided_decoding": {"regex": "[0-9"},
        "requests": [
            user("inherits the broken default"),
            user("own schema", guided_decoding={"json_schema": {"type": "wat"}}),
            user("own valid guide", guided_decoding={"choice": ["ok"]}),
            user("bad grammar", guided_decoding={"ebnf": "root ::= missing"}),
        ],
    }
    results = run_batch(llm, parse_batch(document), warn=lambda _: None).results
    assert results[0].error.startswith("guided_decoding.regex: invalid regex")
    assert results[1].error == "requests[1].guided_decoding.json_schema: invalid json schema: Invalid type: wat"
    assert results[2].error is None and results[2].output_text == "ok"
    assert results[3].error.startswith("requests[3].guided_decoding.ebnf: invalid grammar")
