"""Model families (the ``model_family`` plugin kind)."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch


@attrs.frozen
class SamplingDefaults:
    """Sampler values a family recommends; request fields and flags override them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@attrs.frozen
class SamplingPresets:
    thinking: SamplingDefaults
    non_thinking: SamplingDefaults


@attrs.frozen
class ModelFamily:
    """How to build and load one kind of checkpoint.

    ``architectures``/``model_types`` are matched against the checkpoint's
    config.json. ``build(config, dtype, device)`` returns a
    :class:`ninfer.model.interface.CausalLM` with uninitialised weights.
    ``tiny_config()`` and ``tiny_weights(config, generator)`` let ``ninfer-make-tiny``
    write a small random checkpoint of this family with Hugging Face tensor names.
    ``random_extras(config, generator)``: random tensors, under their checkpoint names, that
    released checkpoints of ``config`` hold but transformers' model of it lacks (the MTP
    head), added to ``random:SHAPE`` models so speculative backends can run on them.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    build: Callable[[dict, torch.dtype, torch.device], Any]
    presets: Callable[[dict], SamplingPresets] | None = None
    tiny_config: Callable[[], dict] | None = None
    tiny_weights: Callable[[dict, torch.Generator], dict[str, torch.Tensor]] | None = None
    random_extras: Callable[[dict, torch.Generator], dict[str, torch.Tensor]] | None = None
    #: the plugins that parse this family's reasoning and tool-call markup (their registry
    #: names); None when the family has none. Families name them: the core assumes no format
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    description: str = ""
