"""Weight formats (the ``weight_format`` plugin kind): how a checkpoint's quantized tensors are read.

A format plugin *claims* a checkpoint from what its directory says (``config.json``'s
``quantization_config``, or a file of its own such as ModelOpt's ``hf_quant_config.json``)
and returns a :class:`WeightScheme`: the format's name as this checkpoint uses it, and a
``convert`` step that turns the checkpoint's tensors into what model families load. Every
quantized linear layer leaves ``convert`` as one item, ``("<module>.weight", QuantWeight)``,
in one of the three layouts of :mod:`ninfer_kernels.quant_formats`; every other tensor
passes through untouched. The core never reads a quantization method itself: it only asks
the plugins, and refuses a checkpoint that says it is quantized when none claims it.

While a quantized checkpoint loads, model families build their linear layers without
device memory (:func:`deferred_linear_weights`) so that a dense copy of a model that only
fits quantized is never allocated.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import attrs

#: files and config keys that say a checkpoint is quantized, whoever reads them
QUANT_CONFIG_KEY = "quantization_config"
QUANT_CONFIG_FILES = ("hf_quant_config.json",)


class WeightFormatError(ValueError):
    """A checkpoint's weights cannot be read as they are: an unsupported format or layer,
    a missing scale, a shape the format's blocks do not divide. ``tensor`` names the
    checkpoint tensor (or module) at fault, when there is one."""

    def __init__(self, reason: str, tensor: Optional[str] = None):
        self.tensor, self.reason = tensor, reason
        super().__init__(f"{tensor}: {reason}" if tensor else reason)


class WeightScheme(Protocol):
    """One checkpoint's quantization, as a claiming plugin reads it."""

    #: what the startup summary and ``--check`` print, e.g. "fp8 e4m3, 128x128 blocks (Qwen)"
    name: str

    def convert(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's ``(name, tensor)`` pairs with each quantized linear layer's
        tensors replaced by one ``(module + ".weight", QuantWeight)``; raises
        :class:`WeightFormatError` for a missing or malformed part."""
        ...


@attrs.frozen
class TinyQuant:
    """What a format's tiny writer returns: the checkpoint's tensors in the format's layout,
    keys to merge into config.json, and extra JSON files (name -> content)."""

    tensors: dict
    config: dict = attrs.field(factory=dict)
    files: dict = attrs.field(factory=dict)


@attrs.frozen
class WeightFormat:
    """A checkpoint weight format.

    ``claim(config, model_dir)`` returns a :class:`WeightScheme` when the checkpoint is in
    this format, else None; it raises :class:`WeightFormatError` for a checkpoint of its
    format that it cannot load (an unsupported variant). ``tiny_writers``: ``ninfer-make-tiny
    --quant NAME`` choices, each ``writer(config, tensors) -> TinyQuant`` quantizing a tiny
    checkpoint's dense tensors into the format's published layout.
    """

    name: str
    claim: Callable[[dict, Path], Optional[WeightScheme]]
    tiny_writers: Mapping[str, Callable[[dict, dict], TinyQuant]] = attrs.field(factory=dict)
    description: str = ""


def quantization_signs(config: dict, model_dir: Path) -> list[str]:
    """Where the checkpoint says it is quantized (empty for a dense checkpoint)."""
    signs = []
    if config.get(QUANT_CONFIG_KEY):
        method = config[QUANT_CONFIG_KEY].get("quant_method", "?") if isinstance(config[QUANT_CONFIG_KEY], dict) else "?"
        signs.append(f"config.json {QUANT_CONFIG_KEY} (quant_method {method!r})")
    signs += [name for name in QUANT_CONFIG_FILES if (Path(model_dir) / name).exists()]
    return signs


def find_scheme(registry, config: dict, model_dir: str | Path) -> Optional[WeightScheme]:
    """The scheme of the first format plugin claiming the checkpoint; None for a dense one.

    A checkpoint that says it is quantized but that no installed plugin claims is refused."""
    model_dir = Path(model_dir)
    for fmt in registry.all("weight_format"):
        scheme = fmt.claim(config, model_dir)
        if scheme is not None:
            return scheme
    signs = quantization_signs(config, model_dir)
    if signs:
        raise WeightFormatError(
            f"the checkpoint is quantized ({'; '.join(signs)}) in a format no installed weight_format plugin "
            f"reads (installed: {', '.join(registry.names('weight_format')) or 'none'})"
        )
    return None


def describe(registry, model_dir: str | Path) -> str:
    """The weight format of the checkpoint in ``model_dir``, as the startup summary names it."""
    path = Path(model_dir) / "config.json"  # read here: the loader would import torch (--check must not)
    if not path.exists():
        return "not known before the checkpoint is built"
    config = json.loads(path.read_text())
    scheme = find_scheme(registry, config, model_dir)
    if scheme is not None:
        return scheme.name
    dtype = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return f"unquantized ({dtype or 'dtype not stated'})"


_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("ninfer_deferred_linear_weights", default=False)


@contextlib.contextmanager
def deferred_linear_weights(active: bool = True) -> Iterator[None]:
    """While active, model families create linear and expert weights on the meta device; the
    loader then gives each the storage its checkpoint tensors need (dense or quantized)."""
    token = _DEFERRED.set(active)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def linear_weights_deferred() -> bool:
    return _DEFERRED.get()
