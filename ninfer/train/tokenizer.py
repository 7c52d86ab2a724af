"""A byte-level BPE fitted to the training corpus, with Qwen's control tokens and chat template.

The pipeline (NFC, Qwen's split pattern, byte-level pre-tokenizer and decoder) is taken
from the tiny tokenizer (:mod:`ninfer.tiny.tokenizer_files`), and so are the files beside
it: ``write_tokenizer_files`` writes the chat template, tokenizer_config.json and the
special-tokens map, and only tokenizer.json and the control tokens' ids (which follow the
learned vocabulary, so they move with its size) are replaced here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from ninfer.tiny import tokenizer_files as tiny


def fit_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A BPE of ``vocab_size`` learned tokens over ``texts``, then the control tokens."""
    template = tiny.build_tokenizer()  # the tiny BPE trains in milliseconds; only its pipeline is kept
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = template.normalizer
    tok.pre_tokenizer = template.pre_tokenizer
    tok.decoder = template.decoder
    tok.post_processor = template.post_processor
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes
        show_progress=False,
    )
    tok.train_from_iterator((line for text in texts for line in text.splitlines(keepends=True)), trainer=trainer)
    for content, special in tiny.ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return tok


def control_token_ids(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id(content) for content, _ in tiny.ADDED_TOKENS]


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> list[int]:
    """One token stream: each document followed by ``<|endoftext|>``."""
    eot = tok.token_to_id(tiny.ENDOFTEXT)
    stream: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eot)
    return stream


def write_tokenizer(out_dir: Path, tok: Tokenizer) -> dict[str, Any]:
    """The tiny tokenizer's files with ``tok`` in place of its BPE; returns the ids
    :func:`ninfer.tiny.tokenizer_files.write_tokenizer_files` returns, for ``tok``."""
    tiny.write_tokenizer_files(out_dir)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = tiny._added_tokens_decoder(tok)
    tiny._write_json(config_path, config)
    ids = {content: tok.token_to_id(content) for content, _ in tiny.ADDED_TOKENS}
    return {
        "eos_token_id": ids[tiny.IM_END],
        "pad_token_id": ids[tiny.ENDOFTEXT],
        "bos_token_id": None,
        "generation_eos_token_ids": [ids[tiny.IM_END], ids[tiny.ENDOFTEXT]],
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "added_token_ids": ids,
    }
