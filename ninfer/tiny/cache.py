"""``tiny:FAMILY`` model references: tiny checkpoints built on first use and cached."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from loguru import logger

from ninfer.model.sources import TINY_PREFIX

PREFIX = TINY_PREFIX


def cache_root() -> Path:
    base = os.environ.get("NINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ninfer")
    return Path(base) / "tiny"


def checkpoint_dir(model: str) -> Path:
    """Where ``model``'s checkpoint is (or will be, for a tiny one not built yet)."""
    if not model.startswith(PREFIX):
        return Path(model)
    family, _, seed = model[len(PREFIX) :].partition(":")
    return cache_root() / f"{family}-seed{seed or 0}"


def resolve_model_path(model: str, registry=None) -> Path:
    """A checkpoint directory for ``model``: a path, or ``tiny:FAMILY[:SEED]``."""
    target = checkpoint_dir(model)
    if not model.startswith(PREFIX):
        return target
    family, _, seed = model[len(PREFIX) :].partition(":")
    if (target / "config.json").exists():
        return target
    from ninfer.tiny.make import make_tiny

    logger.info("building tiny {} checkpoint in {} (first use)", family, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash never leaves half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=target.parent))
    try:
        make_tiny(tmp, family, seed=int(seed or 0), registry=registry)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
