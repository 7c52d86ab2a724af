"""``ninfer-shortlist MODEL_DIR [--corpus PATH ...]``: count the LM-head draft shortlist.

``--lm-head-draft`` scores draft tokens over the most frequent part of the vocabulary
only (:mod:`ninfer_plugins.speculative.shortlist_head`); this command ranks a
checkpoint's vocabulary by how often each token occurs when its own tokenizer encodes a
corpus, and writes ``lm_head_shortlist.json`` beside the weights (format:
:mod:`ninfer.engine.spec.shortlist`). Every added token (chat control tokens, tool and
reasoning markers) ranks first whatever its count. Counting text like the traffic the
server will see gives the best shortlist; without ``--corpus`` the Python standard
library's source is counted, which every machine has.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

#: file names a corpus directory contributes
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".html", ".csv", ".yaml", ".yml")
#: shortlist sizes whose corpus coverage the summary reports
REPORTED_SIZES = (1024, 4096, 16384, 32768, 65536)


def corpus_texts(paths: list[Path], max_bytes: int) -> Iterator[str]:
    """UTF-8 texts of ``paths`` (files, or directories walked for text files) in sorted
    order, until ``max_bytes`` have been read; undecodable files are skipped."""
    used = 0
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES)
        for path in files:
            if used >= max_bytes:
                return
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            used += len(text.encode("utf-8"))
            yield text


def _vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config.get("text_config", config).get("vocab_size") or config["vocab_size"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="ninfer-shortlist",
        description="Rank a checkpoint's vocabulary by frequency over a corpus and write lm_head_shortlist.json "
        "(used by --lm-head-draft).",
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a checkpoint directory (its tokenizer)")
    parser.add_argument("--corpus", type=Path, nargs="+", help="text files or directories (default: the Python "
                        "standard library's source)")
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="stop after this much text (default 64 MiB)")
    parser.add_argument("--out", type=Path, help="where to write (default: MODEL_DIR/lm_head_shortlist.json)")
    args = parser.parse_args(argv)
    if not (args.model_dir / "tokenizer.json").is_file():
        parser.error(f"{args.model_dir} has no tokenizer.json")
    for path in args.corpus or ():
        if not path.exists():
            parser.error(f"--corpus {path}: no such file or directory")

    import torch

    from ninfer.engine.spec.shortlist import FILE, build_shortlist, write_shortlist
    from ninfer.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model_dir)
    corpus = args.corpus or [Path(sysconfig.get_paths()["stdlib"])]
    ids: list[int] = []
    texts = list(corpus_texts(corpus, args.max_bytes))
    for start in range(0, len(texts), 256):  # tokenizers' batch call runs on all cores
        for enc in tok.backend.encode_batch(texts[start : start + 256], add_special_tokens=False):
            ids.extend(enc.ids)
    if not ids:
        sys.exit("ninfer-shortlist: the corpus gave no text to count")
    added = sorted(tok.backend.get_added_tokens_decoder())
    shortlist = build_shortlist(torch.tensor(ids), tok.vocab_size, added, _vocab_size(args.model_dir))
    path = write_shortlist(args.model_dir, shortlist, args.out or args.model_dir / FILE)
    counts = shortlist["counts"]
    coverage = {n: round(sum(counts[:n]) / len(ids), 4) for n in REPORTED_SIZES if n < len(counts)}
    print(json.dumps({"written": str(path), "texts": len(texts), "tokens": len(ids), "vocabulary": len(counts),
                      "control_tokens": len(shortlist["special_token_ids"]), "coverage_by_size": coverage}))


if __name__ == "__main__":
    main()
