"""A PEFT LoRA adapter read from disk: per adapted module its ``A``, ``B`` and scale.

An adapter is a directory holding ``adapter_config.json`` and
``adapter_model.safetensors``, or the path of that ``.safetensors`` file with the
config beside it. Tensor names are PEFT's, ``base_model.model.<module>.lora_A.weight``
(``A`` is ``[r, in]``, ``B`` is ``[out, r]``); module paths are kept relative to the
base model, in the checkpoint's naming, so the registry can route them onto fused layers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ninfer.lora.config import AdapterConfig, LoraAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)(?:\.[^.]+)?\.weight$")
_EMBEDDING = re.compile(r"\.lora_embedding_[AB]")


@dataclass(frozen=True)
class LoraModule:
    """One adapted projection: ``delta = scale * x A^T B^T``."""

    name: str  # module path inside the base model, e.g. model.layers.0.self_attn.q_proj
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    config: AdapterConfig
    modules: tuple[LoraModule, ...]

    @classmethod
    def load(cls, name: str, path: str | Path) -> "LoraAdapter":
        config_path, weights_path = _adapter_files(Path(path))
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LoraAdapterError(f"adapter {name!r}: cannot read {config_path}: {exc}") from exc
        config = AdapterConfig.from_dict(raw, source=str(config_path))
        try:
            tensors = load_file(str(weights_path))
        except (OSError, SafetensorError) as exc:
            raise LoraAdapterError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from exc
        modules = _modules(name, config, tensors)
        return cls(name=name, path=Path(path), config=config, modules=modules)

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def _adapter_files(path: Path) -> tuple[Path, Path]:
    """``(config, weights)`` for an adapter directory or its weights file."""
    if not path.exists():
        raise LoraAdapterError(f"{path}: no such adapter directory or file")
    if path.is_dir():
        folder, weights = path, path / WEIGHTS_FILE
        if not weights.exists():
            if (path / PICKLE_FILE).exists():
                raise LoraAdapterError(
                    f"{path}: only {PICKLE_FILE} found; pickled adapters are not loaded "
                    f"(save with safe_serialization=True to get {WEIGHTS_FILE})"
                )
            raise LoraAdapterError(f"{path}: no {WEIGHTS_FILE}")
    elif path.suffix == ".safetensors" and path.is_file():
        folder, weights = path.parent, path
    elif path.suffix == ".bin":
        raise LoraAdapterError(f"{path}: pickled adapters are not loaded; convert it to safetensors")
    else:
        raise LoraAdapterError(f"{path}: not an adapter directory or .safetensors file")
    config = folder / CONFIG_FILE
    if not config.exists():
        raise LoraAdapterError(f"{folder}: no {CONFIG_FILE} next to the adapter weights")
    return config, weights


def _modules(name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> tuple[LoraModule, ...]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if _EMBEDDING.search(key):
            raise LoraAdapterError(f"adapter {name!r}: LoRA on embeddings is not supported ({key})")
        m = _TENSOR.match(key)
        if m is None:
            raise LoraAdapterError(f"adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        module = m["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m["part"]] = tensor
    if not pairs:
        raise LoraAdapterError(f"adapter {name!r}: the weights file holds no LoRA tensors")
    modules = []
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"A", "B"}:
            raise LoraAdapterError(f"adapter {name!r}: {module} lacks lora_{'B' if 'A' in parts else 'A'}")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoraAdapterError(
                f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                "expected [r, in] and [out, r]"
            )
        if not config.targets(module):
            raise LoraAdapterError(f"adapter {name!r}: {module} has weights but is not in target_modules")
        try:
            scale = config.scale(module, a.shape[0])
        except LoraAdapterError as exc:
            raise LoraAdapterError(f"adapter {name!r}: {exc}") from None
        modules.append(LoraModule(module, a, b, scale))
    return tuple(modules)
