"""The tiny tokenizer files, the Tokenizer wrapper and chat-template parity with transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import unicodedata
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from ninfer.tiny.tokenizer_files import ADDED_TOKENS, TINY_VOCAB_SIZE, write_tokenizer_files
from ninfer.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\nwindows newlines",
    "Café, naïve, Über, straße, ¿dónde? Ελληνικά, Привет",
    "中文测试：你好，世界！日本語のテキスト。한국어",
    "emoji 🙂👍🏽🚀 family 👨‍👩‍👧 flag 🇩🇪 and ❤️",
    'def f(x: int) -> str:\n    return f"{x!r}"  # comment\n',
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2, 3]}}',
    "numbers 1234567890 3.14159 -42 1e-9",
    "control \x00\x01\x7f chars and a replacement char \ufffd in text",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call><tool_response>\n42\n</tool_response><|endoftext|>",
]


def random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0x0A, 0x0A), (0xA0, 0x24F), (0x370, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    # the tokenizer normalizes to NFC (as Qwen's does), so compare NFC text
    return unicodedata.normalize("NFC", "".join(chars))


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


# -- files --------------------------------------------------------------------------------


def test_written_ids_and_vocab(tmp_path: Path) -> None:
    info = write_tokenizer_files(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert info["vocab_size"] == tok.vocab_size == TINY_VOCAB_SIZE <= 600
    assert info["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert info["pad_token_id"] == tok.token_to_id("<|endoftext|>")
    assert info["bos_token_id"] is None
    assert info["generation_eos_token_ids"] == [info["eos_token_id"], info["pad_token_id"]]
    assert sorted(info["added_token_ids"].values()) == list(range(TINY_VOCAB_SIZE - len(ADDED_TOKENS), TINY_VOCAB_SIZE))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tmp_path / "chat_template.jinja").read_text()
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert {v["content"]: v["special"] for v in config["added_tokens_decoder"].values()} == dict(ADDED_TOKENS)


def test_files_are_byte_identical_across_processes(tmp_path: Path, tok_dir: Path) -> None:
    code = "import sys, pathlib, ninfer.tiny.tokenizer_files as f; f.write_tokenizer_files(pathlib.Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    names = sorted(p.name for p in tok_dir.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_control_tokens_are_single_ids(tok: Tokenizer) -> None:
    for content, special in ADDED_TOKENS:
        ids = tok.encode(f"a{content}b")
        token_id = tok.token_to_id(content)
        assert token_id in ids and len(tok.encode(content)) == 1
        assert (token_id in tok.special_token_ids) == special
    assert tok.special_token_ids == {tok.token_to_id(c) for c, s in ADDED_TOKENS if s}


def test_skip_special_tokens_keeps_think_and_tool_markers(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call><|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call>"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


# -- encode / decode ------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randint(1, 60))
        assert tok.decode(tok.encode(text)) == text


def test_nfc_normalization_like_qwen(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("e\u0301")) == "\u00e9"


def test_token_bytes_concatenate_to_utf8(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
    # a single byte token in the upper half is part of a character, not text on its own
    partial = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80]
    assert len(partial) == 128
    # ids past the vocabulary (embedding padding) decode to nothing
    assert tok.token_bytes(tok.vocab_size + 5) == b"" and tok.decode([tok.vocab_size + 5]) == ""


def test_agrees_with_transformers(tok: Tokenizer, hf_tok) -> None:
    rng = random.Random(1)
    texts = TEXTS + [random_text(rng, rng.randint(1, 80)) for _ in range(100)]
    for text in texts:
        ids = tok.encode(text)
        assert hf_tok.encode(text, add_special_tokens=False) == ids
        for skip in (True, False):
            assert hf_tok.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    assert hf_tok.eos_token_id == tok.eos_token_ids[0]
    assert len(hf_tok) == tok.vocab_size


@pytest.mark.parametrize(("gen_eos", "expected"), [(None, ["im_end"]), (7, [7, "im_end"]), ([505, 7], [505, 7])])
def test_eos_ids_from_generation_config(tok_dir: Path, tmp_path: Path, gen_eos, expected) -> None:
    for f in tok_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if gen_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    tok = Tokenizer.from_pretrained(tmp_path)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [im_end if e == "im_end" else e for e in expected]


# -- chat template ----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}

PARTS = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]

CONVERSATIONS: dict[str, tuple[list[dict], dict]] = {
    "plain": ([{"role": "user", "content": "Hi 🙂"}], {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    "no_thinking": ([{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
    "thinking_on": ([{"role": "user", "content": "Hi"}], {"enable_thinking": True}),
    "tools": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"}],
        {"tools": [WEATHER_TOOL]},
    ),
    "tool_round_trip": (
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Two cities, two calls.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "18C"},
            {"role": "tool", "tool_call_id": "b", "content": "25C"},
        ],
        {"tools": [WEATHER_TOOL]},
    ),
    "history_reasoning": (
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "easy"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "\n4", "reasoning_content": "\nalso easy\n"},
        ],
        {"add_generation_prompt": False},
    ),
    "preserve_thinking": (
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "easy"},
            {"role": "user", "content": "2+2?"},
        ],
        {"preserve_thinking": True},
    ),
    "inline_think_and_parts": (
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": PARTS},
            {"role": "assistant", "content": "<think>hidden</think>shown", "tool_calls": None},
            {"role": "system", "content": "late system"},
            {"role": "user", "content": "again"},
        ],
        {},
    ),
    "reasoning_alias": (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}],
        {"add_generation_prompt": False},
    ),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, name: str) -> None:
    messages, kwargs = CONVERSATIONS[name]
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(messages, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs


def render(tok: Tokenizer, name: str) -> str:
    messages, kwargs = CONVERSATIONS[name]
    return tok.apply_chat_template(messages, **kwargs)


def test_template_basic_turns(tok: Tokenizer) -> None:
    assert render(tok, "system") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tok, "no_thinking").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tok, "thinking_on").endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
    )


def test_template_tools_in_system_prompt(tok: Tokenizer) -> None:
    text = render(tok, "tools")
    assert text.startswith("<|im_start|>system\nUse tools.\n\n")
    # key order kept, non-ASCII not escaped
    assert "\n<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>\n" in text
    assert "<tool_call>" in text and text.count("<|im_start|>system") == 1


def test_template_tool_calls_and_responses(tok: Tokenizer) -> None:
    text = render(tok, "tool_round_trip")
    assert (
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text


def test_template_reasoning_history(tok: Tokenizer) -> None:
    text = render(tok, "history_reasoning")
    assert "easy" not in text.split("2+2?")[0]
    assert text.endswith("<|im_start|>assistant\n<think>\nalso easy\n</think>\n\n4<|im_end|>\n")
    kept = render(tok, "preserve_thinking")
    assert "<|im_start|>assistant\n<think>\neasy\n</think>\n\n2<|im_end|>\n" in kept
    dropped = tok.apply_chat_template(CONVERSATIONS["preserve_thinking"][0])
    assert "<|im_start|>assistant\n2<|im_end|>\n" in dropped
    assert "<|im_start|>assistant\na<|im_end|>" not in render(tok, "reasoning_alias")


def test_template_inline_think_and_content_parts(tok: Tokenizer) -> None:
    text = render(tok, "inline_think_and_parts")
    assert "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nshown<|im_end|>\n" in text
    assert "hidden" not in text
    assert "<|im_start|>system\nlate system<|im_end|>\n" in text


def test_template_rejects_unknown_role(tok: Tokenizer) -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported message role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


# -- template sources and helpers -------------------------------------------------------------


def _copy_without_template(src: Path, dst: Path, chat_template) -> None:
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if chat_template is not None:
        config["chat_template"] = chat_template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))


def test_template_sources(tok_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]
    _copy_without_template(tok_dir, tmp_path, named)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template_source == "D{{ messages|length }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "T"
    (tmp_path / "chat_template.jinja").write_text("F")  # the standalone file wins
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "F"
    _copy_without_template(tok_dir, tmp_path, None)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.chat_template_source == ""
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_helpers(tok_dir: Path, tmp_path: Path) -> None:
    source = (
        "{{ strftime_now('%Y') }}|{{ {'b': 1, 'a': 'é'} | tojson }}|{{ eos_token }}|"
        "{% generation %}{{ messages[0].content }}{% endgeneration %}"
        "{% if fail is defined %}{{ raise_exception('boom') }}{% endif %}"
    )
    _copy_without_template(tok_dir, tmp_path, source)
    tok = Tokenizer.from_pretrained(tmp_path)
    year = str(datetime.now().year)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == f'{year}|{{"b": 1, "a": "é"}}|<|im_end|>|x'
    with pytest.raises(jinja2.exceptions.TemplateError, match="boom"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], fail=True)


def test_template_is_sandboxed(tok_dir: Path, tmp_path: Path) -> None:
    _copy_without_template(tok_dir, tmp_path, "{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([])


def test_long_texts_tokenize_without_holding_the_gil(tok: Tokenizer) -> None:
    """A multi-megabyte prompt tokenized on a worker thread must not freeze the event loop:
    another Python thread keeps running while it is encoded (with the GIL held, it would
    get no turn at all until the call returned), and the ids are the short path's."""
    import threading
    import time

    from ninfer.tokenizer import GIL_FREE_CHARS

    text = "Hello <think> world, and more text. " * 15_000  # ~0.5 MB
    assert len(text) > GIL_FREE_CHARS
    ticks, done = [], threading.Event()

    def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.01)
    started = len(ticks)
    ids = tok.encode(text)
    during = len(ticks) - started
    done.set()
    thread.join()
    assert during >= 3, f"the other thread ran {during} times while the text was encoded"
    assert ids == tok.backend.encode(text, add_special_tokens=False).ids
    short = text[:100]
    assert tok.encode(short) == tok.backend.encode_batch([short], add_special_tokens=False)[0].ids
