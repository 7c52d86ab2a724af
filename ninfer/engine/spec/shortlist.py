"""The LM-head draft shortlist file: which vocabulary rows ``--lm-head-draft`` scores.

``lm_head_shortlist.json`` sits beside a checkpoint (format ``ninfer-lm-head-shortlist``,
version 1). ``token_ids`` holds every real token id exactly once (an embedding's padding
rows excluded): the control tokens first, then the rest by descending count in the
corpus it was counted on (ties by id); ``counts`` is aligned with it. A shortlist of
size ``n`` is ``token_ids[:n]``, so every size keeps the control tokens.
``special_token_ids`` lists those, ``vocab_size`` is the checkpoint's (padded)
vocabulary. ``ninfer-train`` writes one for the models it trains; ``ninfer-shortlist``
counts one for any checkpoint (:mod:`ninfer.cli.shortlist`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

FILE = "lm_head_shortlist.json"
FORMAT = "ninfer-lm-head-shortlist"


def build_shortlist(stream: torch.Tensor, num_tokens: int, special: Sequence[int], vocab_size: int) -> dict[str, Any]:
    """The file's content for token stream ``stream`` (int64) over ids ``0 .. num_tokens - 1``."""
    counts = torch.bincount(stream, minlength=num_tokens)[:num_tokens].tolist()
    special = [t for t in dict.fromkeys(special) if 0 <= t < num_tokens]
    skip = set(special)
    rest = sorted((i for i in range(num_tokens) if i not in skip), key=lambda i: (-counts[i], i))
    order = special + rest
    return {
        "format": FORMAT,
        "version": 1,
        "vocab_size": vocab_size,
        "special_token_ids": special,
        "token_ids": order,
        "counts": [counts[i] for i in order],
    }


def write_shortlist(out_dir: Path, shortlist: dict[str, Any], path: Optional[Path] = None) -> Path:
    """Write ``shortlist`` as ``out_dir / FILE`` (or to ``path``); returns where it went."""
    path = Path(path) if path is not None else Path(out_dir) / FILE
    path.write_text(json.dumps(shortlist) + "\n", encoding="utf-8")
    return path


def read_shortlist(model_dir: Optional[Path], size: int, vocab_size: int) -> list[int]:
    """The first ``size`` ids of the checkpoint's shortlist (ids past the vocabulary dropped)."""
    path = Path(model_dir or ".") / FILE
    if not path.is_file():
        raise ValueError(f"speculative.lm_head_draft: no {FILE} beside the checkpoint ({path}); count one with "
                         "`ninfer-shortlist MODEL_DIR` (ninfer-train writes one for the models it trains)")
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT or not isinstance(data.get("token_ids"), list):
        raise ValueError(f"speculative.lm_head_draft: {path} is not a {FORMAT} file")
    ids = [int(t) for t in data["token_ids"] if 0 <= int(t) < vocab_size]
    return list(dict.fromkeys(ids))[:size]
