"""Reading a Hugging Face checkpoint directory and building the matching model.

A directory holds ``config.json``, optionally ``generation_config.json``, and weights
as one ``model.safetensors`` or several shards listed in ``model.safetensors.index.json``.
The model family is picked through the plugin registry, so the loader itself knows no
architecture; a quantized checkpoint is read through the weight-format plugin that claims
it (:mod:`ninfer.model.weight_format`), so the loader knows no quantization format either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from loguru import logger
from safetensors import safe_open
from tqdm import tqdm

from ninfer.model.family import ModelFamily
from ninfer.model.weight_format import deferred_linear_weights, find_scheme
from ninfer.plugins import PluginRegistry, UnknownCapabilityError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's generation defaults (eos ids, sampler values); empty when absent."""
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (``dtype``, or the older ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return found


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as ``(name, cpu tensor)``, with a progress bar on stderr."""
    files = weight_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    logger.info("loading {} tensors from {} file(s) in {}", total, len(files), model_dir)
    with tqdm(total=total, desc="loading weights", unit="tensor", leave=False, disable=None) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update()


def find_family(registry: PluginRegistry, config: dict[str, Any]) -> ModelFamily:
    """The family claiming the config's ``architectures``, else its ``model_type``."""
    families = registry.all("model_family")
    for arch in config.get("architectures") or ():
        for family in families:
            if arch in family.architectures:
                return family
    model_type = config.get("model_type")
    for family in families:
        if model_type in family.model_types:
            return family
    wanted = ", ".join([*(config.get("architectures") or ()), str(model_type)])
    raise UnknownCapabilityError(
        "model_family", wanted, registry.names("model_family"), key="config.json architectures/model_type"
    )


def load_model(
    model_dir: str | Path,
    registry: PluginRegistry,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_context: int | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> tuple[Any, dict[str, Any], ModelFamily]:
    """Build and fill the model for ``model_dir``: returns ``(model, config, family)``.

    ``dtype`` None keeps the checkpoint's own dtype (bfloat16 when it names none).
    ``max_context`` beyond the checkpoint's ``max_position_embeddings`` extends the
    position tables (with a warning) so long sequences never index past them.
    ``weights``: the checkpoint's tensors by name from somewhere other than the directory's
    safetensors files (a model already in memory, e.g. the benchmarks' random ones).
    The weight format (dense, or the claiming plugin's scheme) is logged and kept on the
    model as ``weight_format``.
    """
    config = read_config(model_dir)
    trained = config.get("max_position_embeddings")
    if max_context is not None and trained is not None and max_context > trained:
        logger.warning("max context {} exceeds the checkpoint's max_position_embeddings {}; "
                       "positions past it are extrapolated", max_context, trained)
        config = {**config, "max_position_embeddings": max_context}
    family = find_family(registry, config)
    dtype = dtype or config_dtype(config) or torch.bfloat16
    scheme = find_scheme(registry, config, model_dir)
    weight_format = scheme.name if scheme is not None else f"unquantized, loaded as {dtype}"
    logger.info("model family {} ({}), dtype {}, device {}, weights {}", family.name, model_dir, dtype, device,
                weight_format)
    with deferred_linear_weights(scheme is not None):
        model = family.build(config, dtype, torch.device(device))
    stream = iter_weights(model_dir) if weights is None else weights
    model.load_weights(scheme.convert(stream) if scheme is not None else stream)
    model.weight_format = weight_format
    return model, config, family
