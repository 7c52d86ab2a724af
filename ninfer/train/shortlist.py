"""The frequency-ranked vocabulary shortlist written beside a trained checkpoint.

``lm_head_shortlist.json`` (format ``ninfer-lm-head-shortlist``, version 1) holds
``token_ids``: every real token id exactly once (padding rows of the embedding excluded),
the control tokens first, then the rest by descending count in the training stream
(ties by id); ``counts`` is aligned with it. A shortlist of size ``n`` is simply
``token_ids[:n]``, so every size keeps the control tokens. ``special_token_ids`` lists
those, ``vocab_size`` is the checkpoint's (padded) vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

FILE = "lm_head_shortlist.json"
FORMAT = "ninfer-lm-head-shortlist"


def build_shortlist(stream: torch.Tensor, num_tokens: int, special: Sequence[int], vocab_size: int) -> dict[str, Any]:
    counts = torch.bincount(stream, minlength=num_tokens)[:num_tokens].tolist()
    special = list(dict.fromkeys(special))
    rest = sorted((i for i in range(num_tokens) if i not in set(special)), key=lambda i: (-counts[i], i))
    order = special + rest
    return {
        "format": FORMAT,
        "version": 1,
        "vocab_size": vocab_size,
        "special_token_ids": special,
        "token_ids": order,
        "counts": [counts[i] for i in order],
    }


def write_shortlist(out_dir: Path, shortlist: dict[str, Any]) -> Path:
    path = Path(out_dir) / FILE
    path.write_text(json.dumps(shortlist) + "\n", encoding="utf-8")
    return path
