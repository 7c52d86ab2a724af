"""Reading and vetting a PEFT ``adapter_config.json``.

Only plain LoRA is served: ``y = W x + scale * B A x`` on linear layers. Every PEFT
option that would change that formula at inference time is refused by name, so an
adapter never runs with a silently different meaning; options that only matter for
training (dropout, initialisation schemes) are ignored.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional, Union

import attrs

from ninfer.errors import InvalidRequestError


class LoraAdapterError(InvalidRequestError, ValueError):
    """An adapter cannot be loaded: missing files, bad tensors, or unsupported options."""

    code = "invalid_lora_adapter"


#: options that change inference behaviour, with what they are; refused when set
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "fan_in_fan_out": "transposed (Conv1D-style) base weights (fan_in_fan_out)",
    "lora_bias": "a trainable bias in lora_B (lora_bias)",
    "use_qalora": "QA-LoRA pooling (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters such as MoE experts (target_parameters)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
}

#: ``target_modules`` value PEFT expands to every linear layer but the output head
ALL_LINEAR = "all-linear"


@attrs.frozen
class AdapterConfig:
    """The inference-relevant part of an adapter config."""

    r: int
    lora_alpha: float
    target_modules: Union[str, tuple[str, ...]]
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = attrs.field(factory=dict)
    alpha_pattern: Mapping[str, float] = attrs.field(factory=dict)
    exclude_modules: Union[str, tuple[str, ...], None] = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "adapter_config.json") -> "AdapterConfig":
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise LoraAdapterError(f"{source}: peft_type {peft_type!r} is not supported (only LORA)")
        refused = [what for key, what in _UNSUPPORTED.items() if raw.get(key)]
        if refused:
            raise LoraAdapterError(f"{source}: unsupported adapter feature(s): {', '.join(refused)}")
        if raw.get("bias", "none") != "none":
            raise LoraAdapterError(f"{source}: bias={raw['bias']!r} is not supported (only 'none')")
        for key in ("r", "lora_alpha", "target_modules"):
            if raw.get(key) is None:
                raise LoraAdapterError(f"{source}: missing {key!r}")
        targets = raw["target_modules"]
        exclude = raw.get("exclude_modules")
        return cls(
            r=int(raw["r"]),
            lora_alpha=float(raw["lora_alpha"]),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            exclude_modules=exclude if exclude is None or isinstance(exclude, str) else tuple(exclude),
        )

    def targets(self, module: str) -> bool:
        """Whether ``module`` (a path inside the base model) is one this adapter adapts."""
        if _listed(self.exclude_modules, module):
            return False
        if self.target_modules == ALL_LINEAR:
            return True
        return _listed(self.target_modules, module)

    def scale(self, module: str, rank: int) -> float:
        """The factor on ``B A x`` for ``module`` whose tensors have rank ``rank``."""
        expected = int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r))
        if expected != rank:
            raise LoraAdapterError(f"{module}: tensors have rank {rank}, the config says {expected}")
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _listed(spec: Union[str, tuple[str, ...], None], module: str) -> bool:
    """PEFT's module selection: a string is a full-match regex, a list matches name suffixes."""
    if not spec:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return module in spec or any(module.endswith(f".{name}") for name in spec)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> Optional[str]:
    """The first rank/alpha pattern that matches a dotted suffix of ``module`` (as PEFT does)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None
