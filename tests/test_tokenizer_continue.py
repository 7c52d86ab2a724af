"""``continue_final_message``: the last message is left open for generation to continue,
rendered exactly as ``transformers`` renders it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.tokenizer import Tokenizer

CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],
    "trailing_space": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ends with a space "}],
    "parts": [{"role": "user", "content": "Hi"},
              {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "reasoning": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "x", "reasoning_content": "r"}],
    "empty": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
    "user_last": [{"role": "user", "content": "Complete: once upon"}],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
def test_matches_transformers(tok: Tokenizer, tok_dir: Path, name: str, thinking: bool) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, continue_final_message=True, enable_thinking=thinking)
    theirs = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True, enable_thinking=thinking)
    assert ours == theirs


def test_the_turn_stays_open(tok: Tokenizer) -> None:
    messages = CONVERSATIONS["text"]
    closed = tok.apply_chat_template(messages, add_generation_prompt=False)
    continued = tok.apply_chat_template(messages, continue_final_message=True)
    assert continued.endswith("The answer is") and closed.startswith(continued)
    assert closed[len(continued):] == "<|im_end|>\n"
    assert messages[-1]["content"] == "The answer is"  # the caller's messages are left alone
    # the default still opens a new assistant turn
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_misuse_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="cannot be combined"):
        tok.apply_chat_template(CONVERSATIONS["text"], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="no text"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], continue_final_message=True)
    with pytest.raises(ValueError, match="needs a message"):
        tok.apply_chat_template([], continue_final_message=True)
