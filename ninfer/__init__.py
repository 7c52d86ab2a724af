"""ninfer: an LLM inference server and batch runner for Qwen-family checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `ninfer-serve --help` and profile checks never import torch.
    if name == "LLM":
        from ninfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ninfer.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
