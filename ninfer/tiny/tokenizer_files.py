"""Tokenizer files for tiny test checkpoints: a small byte-level BPE shaped like Qwen3's.

The BPE is trained on ``corpus.txt`` (shipped next to this module) with the same
normalizer, pre-tokenizer and decoder that ``transformers``' ``Qwen2Tokenizer``
builds, so both ``tokenizers`` and ``transformers.AutoTokenizer`` load the files and
agree token for token. Qwen's control tokens follow the learned vocabulary, in Qwen's
relative order. Training is deterministic, so the written files are byte-identical
across runs and processes.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

#: total vocabulary of the tiny tokenizer, control tokens included
TINY_VOCAB_SIZE = 512

#: the pre-tokenizer split Qwen2/Qwen3 use: letters, single digits, punctuation runs, newlines
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

#: (content, special): chat markers are special; tool/think markers decode as text, as in Qwen3
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

MODEL_MAX_LENGTH = 32768


def _corpus() -> str:
    return resources.files("ninfer.tiny").joinpath("corpus.txt").read_text(encoding="utf-8")


def _chat_template() -> str:
    return resources.files("ninfer.tiny").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def build_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE and append the control tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(ADDED_TOKENS),
        # every byte gets a token, so any text encodes without an unknown token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus().splitlines(keepends=True), trainer=trainer)
    learned = tok.get_vocab_size(with_added_tokens=False)
    if learned != TINY_VOCAB_SIZE - len(ADDED_TOKENS):
        raise RuntimeError(f"corpus.txt is too small: BPE learned only {learned} tokens")
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    return {
        str(tok.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and
    special_tokens_map.json into ``out_dir``.

    Returns the ids a checkpoint's config.json / generation_config.json need:
    ``eos_token_id`` (``<|im_end|>``), ``pad_token_id`` (``<|endoftext|>``),
    ``bos_token_id`` (None, as in Qwen3), ``generation_eos_token_ids`` (both end
    markers, as Qwen3's generation_config lists them), ``vocab_size`` (the real
    tokenizer size) and ``added_token_ids`` (content -> id for every control token).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    template = _chat_template()
    special = [content for content, is_special in ADDED_TOKENS if is_special and content != ENDOFTEXT]

    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": _added_tokens_decoder(tok),
            "additional_special_tokens": special,
            "bos_token": None,
            "chat_template": template,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "errors": "replace",
            "model_max_length": MODEL_MAX_LENGTH,
            "pad_token": ENDOFTEXT,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {"additional_special_tokens": special, "eos_token": IM_END, "pad_token": ENDOFTEXT},
    )
    ids = {content: tok.token_to_id(content) for content, _ in ADDED_TOKENS}
    return {
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "bos_token_id": None,
        "generation_eos_token_ids": [ids[IM_END], ids[ENDOFTEXT]],
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "added_token_ids": ids,
    }
