"""The plugin contract: one hook per capability kind.

Every hook receives a ``register`` callback. A plugin calls it once per capability it
offers, passing an object that carries a unique ``name`` within its kind. Built-in
capabilities use exactly these hooks, loaded from the ``ninfer`` entry-point group.
docs/plugins.md describes each kind's object in detail.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("ninfer")
hookimpl = pluggy.HookimplMarker("ninfer")


@hookspec
def register_model_families(register):
    """Offer model families: ``register(ninfer.model.family.ModelFamily(...))``.

    A family maps Hugging Face ``architectures`` / ``model_type`` values to a torch
    module implementing :class:`ninfer.model.interface.CausalLM`, and carries its
    sampling presets and tiny-checkpoint recipe.
    """


@hookspec
def register_kv_dtypes(register):
    """Offer KV-cache storage formats: ``register(ninfer.model.kv.KVDtype(...))``.

    Selected by the profile's ``engine.kv_dtype``. A format allocates the paged cache
    and implements writing new keys/values and attending over them.
    """


@hookspec
def register_speculative_backends(register):
    """Offer speculative decoders: ``register(ninfer.capabilities.SpeculativeBackend(...))``.

    Selected by ``speculative.backend`` (``--spec``); declares its draft-token range.
    """


@hookspec
def register_tool_parsers(register):
    """Offer tool-call parsers: ``register(ninfer.capabilities.ToolParser(...))``.

    Turns model output markup into structured tool calls, incrementally.
    """


@hookspec
def register_reasoning_parsers(register):
    """Offer reasoning parsers: ``register(ninfer.capabilities.ReasoningParser(...))``.

    Splits generated text into reasoning and answer channels.
    """


@hookspec
def register_protocols(register):
    """Offer HTTP protocol adapters: ``register(ninfer.capabilities.Protocol(...))``.

    Each adapter contributes route handlers translating one wire API to engine requests.
    """


@hookspec
def register_guided_decoding_backends(register):
    """Offer constrained-decoding engines: ``register(ninfer.capabilities.GuidedDecodingBackend(...))``.

    Compiles schemas, regexes and grammars into per-step token masks.
    """


@hookspec
def register_weight_formats(register):
    """Offer checkpoint weight formats: ``register(ninfer.model.weight_format.WeightFormat(...))``.

    A format claims a checkpoint from its directory (``quantization_config`` or a file of
    its own) and converts its quantized tensors into the in-memory layouts of
    ``ninfer_kernels.quant_formats`` at load time.
    """
