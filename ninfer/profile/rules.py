"""Checks that involve more than one key; per-key checks live in the schema."""

from __future__ import annotations

import attrs

from ninfer.model.sources import RANDOM_PREFIX, TINY_PREFIX
from ninfer.profile.schema import SPEC_DRAFT_RANGES, Profile

REDACTED = "<redacted>"


def cross_checks(p: Profile) -> list[str]:
    """Every rule the profile breaks, as ``key.path: message`` lines."""
    errors: list[str] = []
    if p.model is None:
        errors.append("model: required: a checkpoint directory, tiny:FAMILY or random:SHAPE (give MODEL_PATH "
                      "or set it in the profile)")
    elif p.model.startswith(TINY_PREFIX) and not p.model[len(TINY_PREFIX):]:
        errors.append("model: tiny:FAMILY needs a family name, e.g. tiny:qwen3")
    elif p.model.startswith(RANDOM_PREFIX):
        from ninfer.model import random_weights  # (imports torch: only for random models)

        try:
            random_weights.shape_of(p.model)
        except ValueError as e:
            errors.append(f"model: {e}")
    if p.server.api_key == REDACTED:
        errors.append(f"server.api_key: {REDACTED!r} is what --check prints in place of the key; give the "
                      "real key, e.g. ${NINFER_API_KEY}")
    errors += _speculative(p)
    errors += _lora_modules(p.server.lora_modules or [])
    if not p.engine.prefix_reuse:
        # Root-only mode has no context cache, so sizing one is a contradiction even at zero.
        for f in attrs.fields(type(p.cache)):
            if getattr(p.cache, f.name) is not None:
                errors.append(f"cache.{f.name}: not allowed when engine.prefix_reuse is false "
                              "(--no-prefix-reuse runs without a context cache)")
    return errors


def lora_modules(items: list[str]) -> dict[str, str]:
    """``server.lora_modules`` ("NAME=PATH" items) as {name: path}; assumes they passed the checks."""
    return dict(item.split("=", 1) for item in items)


def _lora_modules(items: list[str]) -> list[str]:
    errors, seen = [], set()
    for item in items:
        name, sep, path = item.partition("=")
        if not (sep and name.strip() and path.strip()) or name != name.strip():
            errors.append(f"server.lora_modules: {item!r} must be NAME=PATH (an adapter name, then its directory)")
        elif name in seen:
            errors.append(f"server.lora_modules: the adapter name {name!r} is given twice")
        seen.add(name)
    return errors


def _speculative(p: Profile) -> list[str]:
    s = p.speculative
    if s.backend is None:
        return [f"speculative.{name}: needs speculative.backend (--spec)"
                for name, given in (("draft_tokens", s.draft_tokens is not None), ("lm_head_draft", s.lm_head_draft))
                if given]
    lo, hi = SPEC_DRAFT_RANGES.get(s.backend, (1, None))
    allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    if s.draft_tokens is None:
        return [f"speculative.draft_tokens: required with speculative.backend {s.backend!r} ({allowed})"]
    if hi is not None and not lo <= s.draft_tokens <= hi:
        return [f"speculative.draft_tokens: expected an integer in {allowed} for speculative.backend "
                f"{s.backend!r}, got {s.draft_tokens}"]
    return []
