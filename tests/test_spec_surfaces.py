"""Speculative decoding as users see it: the server's timings, the batch runner's summary."""

from __future__ import annotations

import json

import httpx
from server_harness import running_server

from ninfer import LLM, SamplingParams
from ninfer.batch.runner import run_batch
from ninfer.batch.output import summary_json
from ninfer.batch.schema import parse_batch

REPEATING = "one two three four one two three four one two three four one two"


def test_the_server_reports_drafts_in_llama_cpp_timings():
    with running_server("--spec", "ngram", "--draft-tokens", "3", "--max-context", "512") as url:
        body = {"messages": [{"role": "user", "content": REPEATING}], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        timings = answer["timings"]
        assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0 and timings["draft_n"] > 0
        assert answer["usage"]["completion_tokens"] == 24
        assert "speculative decoding: ngram" in url.logs()
    with running_server("--max-context", "512") as url:  # without speculation the fields are absent
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert "draft_n" not in answer["timings"]


def test_the_batch_runner_speculates_per_request_and_reports_it(tiny_qwen3):
    settings = dict(dtype="fp32", device="cpu", max_concurrency=4, block_size=4, max_context=256)
    plain, spec = LLM(str(tiny_qwen3), **settings), LLM(str(tiny_qwen3), spec="ngram", draft_tokens=3, **settings)
    doc = {"temperature": 0.0, "max_generate_length": 24, "apply_chat_template": False,
           "requests": [{"messages": [{"role": "user", "content": REPEATING}]},
                        {"messages": [{"role": "user", "content": REPEATING}], "disable_spec_decode": True}]}
    expected = [r.output_text for r in run_batch(plain, parse_batch(json.loads(json.dumps(doc))), warn=print).results]
    batch = parse_batch(doc)
    run = run_batch(spec, batch, warn=print)
    assert [r.output_text for r in run.results] == expected
    summary = summary_json(run, batch, "tiny", 0.0)["speculative_decoding"]
    assert summary["backend"] == "ngram" and summary["requests_disabling"] == 1
    assert summary["rounds"] > 0 and summary["draft_tokens"] >= summary["accepted_tokens"]
    assert summary["acceptance_length"] >= 1.0


def test_ninfer_shortlist_counts_a_checkpoint_s_vocabulary(tmp_path, capsys):
    """The command ranks the vocabulary over a corpus (control tokens first, then by
    count), writes the file beside the checkpoint, and --lm-head-draft reads it."""
    from ninfer.cli.shortlist import main
    from ninfer.engine.spec.shortlist import read_shortlist
    from ninfer.tiny.make import make_tiny
    from ninfer.tokenizer import Tokenizer

    model = make_tiny(tmp_path / "m", "qwen3_5", seed=0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("zebra " * 300 + "apple " * 100)
    (corpus / "b.md").write_text("apple banana " * 50)
    (corpus / "skip.bin").write_bytes(b"\xff\xfe" * 10)  # not a text file: never read
    main([str(model), "--corpus", str(corpus)])
    summary = json.loads(capsys.readouterr().out)
    data = json.loads((model / "lm_head_shortlist.json").read_text())
    tok = Tokenizer.from_pretrained(model)
    control = sorted(tok.backend.get_added_tokens_decoder())
    assert data["format"] == "ninfer-lm-head-shortlist" and data["special_token_ids"] == control
    assert data["token_ids"][: len(control)] == control
    rest = data["counts"][len(control):]
    assert rest == sorted(rest, reverse=True) and sorted(data["token_ids"]) == list(range(tok.vocab_size))
    zebra = tok.encode(" zebra")
    assert data["token_ids"][len(control)] in zebra  # the most frequent word's token leads the rest
    assert summary["tokens"] == sum(data["counts"]) and summary["texts"] == 2
    assert read_shortlist(model, 12, tok.vocab_size) == data["token_ids"][:12]
