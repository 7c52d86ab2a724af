"""Filling in derived defaults, and matching a profile's plugin choices to a registry."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ninfer.profile.schema import GUIDED_OFF, Media, Profile

if TYPE_CHECKING:
    from ninfer.plugins import PluginRegistry

HOST_STATE_SLOTS = 8
HOST_KV_MIB = 8192
LONG_ANCHORS_PER_CONTINUATION = 2
#: media sizing options: meaningless until image and video input exists
MEDIA_BUDGETS = ("media_cache_mib", "media_live_mib", "media_preprocess_threads")


def resolve(profile: Profile) -> Profile:
    """The profile with every derived default filled in; values already set are kept.

    ``kv_capacity`` follows ``max_context`` (``"auto"`` stays for the engine to size).
    Context-cache capacities are left None when prefix reuse is off: that mode has no
    cache, and leaving them unset keeps the printed profile loadable again.
    """
    e, c = profile.engine, profile.cache
    engine = attrs.evolve(e, kv_capacity=e.max_context if e.kv_capacity is None else e.kv_capacity)
    if not e.prefix_reuse:
        return attrs.evolve(profile, engine=engine)
    n = e.max_concurrency
    derived = {
        "device_state_slots": n,
        "host_state_slots": HOST_STATE_SLOTS,
        "host_kv_mib": HOST_KV_MIB,
        "max_private_continuations": 2 * n,
        "max_shared_prefixes": max(n, 4),
        "max_long_anchors_per_continuation": LONG_ANCHORS_PER_CONTINUATION,
    }
    cache = attrs.evolve(c, **{k: v for k, v in derived.items() if getattr(c, k) is None})
    return attrs.evolve(profile, engine=engine, cache=cache)


def check_selections(profile: Profile, registry: PluginRegistry) -> list[str]:
    """Every plugin the profile names but the registry lacks, as ``key.path: ...`` messages.

    Also checks ``speculative.draft_tokens`` against the chosen backend's declared range,
    and refuses options whose machinery this install does not have.
    ``None`` selections mean "the default" and are not checked here.
    """
    from ninfer.plugins import UnknownCapabilityError

    wanted: list[tuple[str, str, str | None]] = [
        ("kv_dtype", "engine.kv_dtype", profile.engine.kv_dtype),
        ("speculative_backend", "speculative.backend", profile.speculative.backend),
        ("tool_parser", "tools.parser", profile.tools.parser),
        ("reasoning_parser", "reasoning.parser", profile.reasoning.parser),
        ("guided_decoding", "guided.backend", None if profile.guided.backend == GUIDED_OFF else profile.guided.backend),
        *(("protocol", "server.protocols", name) for name in profile.server.protocols or ()),
    ]
    errors = []
    for kind, key, name in wanted:
        if name is None:
            continue
        try:
            obj = registry.get(kind, name, key=key)
        except UnknownCapabilityError as e:
            errors.append(str(e))
            continue
        draft = profile.speculative.draft_tokens
        if kind == "speculative_backend" and draft is not None:
            lo, hi = obj.draft_tokens
            if not lo <= draft <= hi:
                errors.append(f"speculative.draft_tokens: the {name} backend accepts {lo}..{hi}, got {draft}")
        if kind == "speculative_backend" and profile.speculative.lm_head_draft and not obj.lm_head_draft:
            errors.append(f"speculative.lm_head_draft: the {name} backend drafts without an LM head")
    return (errors + _unavailable(profile, registry) + _missing_adapters(profile) + request_log_errors(profile)
            + context_cost_errors(profile))


def model_errors(profile: Profile, registry: PluginRegistry) -> list[str]:
    """Why ``model`` cannot be loaded, as far as is known without loading it: a checkpoint
    directory must exist and hold config.json; ``tiny:FAMILY`` must name an installed family
    that can build a tiny checkpoint. (random shapes are checked with the profile.)"""
    from ninfer.model.sources import RANDOM_PREFIX, TINY_PREFIX
    from ninfer.tiny.cache import checkpoint_dir

    reference = profile.model
    if reference.startswith(RANDOM_PREFIX):
        return []
    if reference.startswith(TINY_PREFIX):
        family = reference[len(TINY_PREFIX):].partition(":")[0]
        if family not in registry.items["model_family"]:
            names = ", ".join(registry.names("model_family")) or "none installed"
            return [f"model: {reference}: no model family {family!r} (available: {names})"]
        built = (checkpoint_dir(reference) / "config.json").exists()
        if not built and getattr(registry.get("model_family", family), "tiny_config", True) is None:
            return [f"model: {reference}: the {family} family has no tiny-checkpoint recipe"]
        return []
    path = Path(reference)
    if not path.is_dir():
        why = "not a directory" if path.exists() else "no such checkpoint directory"
        return [f"model: {reference}: {why}"]
    if not (path / "config.json").is_file():
        return [f"model: {reference}: no config.json (a checkpoint directory holds the model's config.json)"]
    return []


def _missing_adapters(profile: Profile) -> list[str]:
    """LoRA adapters whose path is absent: refused before the model loads (the files are read at load)."""
    items = (item.partition("=") for item in profile.server.lora_modules or ())
    return [f"server.lora_modules: the adapter {name!r}: {path}: no such adapter directory or file"
            for name, _, path in items if path and not Path(path).exists()]


def _unavailable(profile: Profile, registry: PluginRegistry) -> list[str]:
    """Options this install cannot honour yet: refused rather than silently ignored."""
    errors = []
    if profile.media.vision:
        errors.append("media.vision: image and video input is not available in this build yet")
    defaults = Media()
    for name in MEDIA_BUDGETS:
        if getattr(profile.media, name) != getattr(defaults, name):
            errors.append(f"media.{name}: this build prepares no media (image and video input is not available "
                          "yet), so there is nothing to size")
    return errors


def not_honoured(given: Profile) -> list[str]:
    """Options accepted but not acted on yet, as ``key.path: ...`` warnings (none today).

    ``given`` is the profile before :func:`resolve`, so only values the user set are
    named (resolution fills derived defaults in for every profile).
    """
    return []


def auto_pool(engine: Any, device: str) -> str:
    """How ``kv_capacity: auto`` sizes the pool on ``device`` (cpu, cuda...), for the logs."""
    if device == "cpu":
        return f"{engine.max_context} context x {engine.max_concurrency} concurrency on CPU"
    return "sized from free device memory once the model is loaded"


def capacity_warnings(profile: Profile) -> list[str]:
    """Combinations that start but serve less than they say, as ``key.path: ...`` warnings.

    ``profile`` is resolved. One request alone may use the whole KV pool and no more, so a
    pool smaller than ``max_context`` caps every request below the context ceiling.
    """
    e = profile.engine
    if isinstance(e.kv_capacity, int) and e.kv_capacity < e.max_context:
        return [f"engine.kv_capacity: {e.kv_capacity} tokens is below engine.max_context ({e.max_context}); no "
                f"request can outgrow the KV pool, so requests, and the max_model_len /v1/models reports, stop "
                f"near {e.kv_capacity} tokens"]
    return []


def context_cost_errors(profile: Profile) -> list[str]:
    """Why ``engine.context_cost_presets`` cannot be used (read and checked before the model loads)."""
    from ninfer.engine.context_cost import ContextCostError, load_presets

    path = profile.engine.context_cost_presets
    if path is None:
        return []
    try:
        load_presets(path)
    except ContextCostError as exc:
        return [f"engine.context_cost_presets: {path}: {exc}"]
    return []


def request_log_errors(profile: Profile) -> list[str]:
    """Why ``logging.request_log_jsonl`` cannot be the request log, checked before the model loads.

    Its directory must exist (it is never created), it must not be (or be inside) the
    model, and the file must open for appending: an existing file is opened and closed
    unchanged; a new one is created and removed again, so ``--check`` leaves nothing behind.
    """
    path = profile.logging.request_log_jsonl
    if path is None:
        return []
    key = "logging.request_log_jsonl"
    target = Path(path).resolve()  # symlinks followed: the file actually written
    if not target.parent.is_dir():
        return [f"{key}: {path}: the directory {target.parent} does not exist (it is not created)"]
    if target.is_dir():
        return [f"{key}: {path} is a directory"]
    model = _model_location(profile.model)
    if model is not None and (target == model or model in target.parents):
        return [f"{key}: {path} resolves into the model {profile.model} ({model}); write the log elsewhere"]
    try:
        if target.exists():
            open(target, "a").close()
        else:
            open(target, "x").close()
            target.unlink()
    except OSError as exc:
        return [f"{key}: {path} cannot be opened for appending: {exc.strerror or exc}"]
    return []


def _model_location(reference: str) -> Path | None:
    """Where the model's files are (None for a random shape, which has none)."""
    from ninfer.model.sources import RANDOM_PREFIX
    from ninfer.tiny.cache import checkpoint_dir

    return None if reference.startswith(RANDOM_PREFIX) else checkpoint_dir(reference).resolve()
