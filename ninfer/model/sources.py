"""Where a model reference's checkpoint comes from: a directory, ``tiny:FAMILY`` or ``random:SHAPE``.

The engine builder asks this module and nothing else, so the demo/test checkpoint maker
(:mod:`ninfer.tiny`) and the random-shape builder (:mod:`ninfer.model.random_weights`,
which needs transformers) are imported only when a reference names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from loguru import logger

if TYPE_CHECKING:
    import torch

#: the reference prefixes (light to import: profile checks read them without torch)
TINY_PREFIX = "tiny:"
RANDOM_PREFIX = "random:"

Weights = Optional[Iterable[tuple[str, Any]]]


def resolve_source(reference: str, registry, dtype: "torch.dtype", device: "torch.device",
                   seed: int = 0) -> tuple[Path, Weights]:
    """The checkpoint directory for ``reference`` and, for random shapes, the weights that
    stand in for its files (None: the loader reads the directory's safetensors); ``seed``
    draws random shapes' weights."""
    if reference.startswith(RANDOM_PREFIX):
        from ninfer.model import random_weights

        logger.info("building {} in device memory: transformers initialises it, then it streams into our loader",
                    reference)
        family = _family_of(random_weights.SHAPES[random_weights.shape_of(reference)], registry)
        extras = family.random_extras if family is not None else None
        path, weights = random_weights.model_source(reference, dtype, device, seed, extras=extras,
                                                     registry=registry)
        return Path(path), weights
    if reference.startswith(TINY_PREFIX):
        from ninfer.tiny.cache import resolve_model_path

        return resolve_model_path(reference, registry), None
    return Path(reference), None


def checkpoint_path(reference: str) -> Optional[Path]:
    """Where ``reference``'s checkpoint is (or will be built, for ``tiny:``) without building
    anything; None for ``random:`` shapes, which have no files."""
    if reference.startswith(RANDOM_PREFIX):
        return None
    if reference.startswith(TINY_PREFIX):
        from ninfer.tiny.cache import checkpoint_dir

        return checkpoint_dir(reference)
    return Path(reference)


def _family_of(config: dict, registry):
    from ninfer.model.loader import find_family

    try:
        return find_family(registry, config)
    except LookupError:
        return None  # the loader reports a missing family with its own error


def public_id(reference: str, model_dir: Path) -> str:
    """The id a server reports when ``--model-id`` is absent: the reference for built
    models, else the checkpoint folder's name."""
    return reference if reference.startswith((TINY_PREFIX, RANDOM_PREFIX)) else model_dir.name
