"""Prompt-processing rate: one long prompt, first token out, for both engines."""

from __future__ import annotations

import time

import torch

from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ninfer_prefill(engine, prompts: list[list[int]], device: torch.device) -> dict:
    """Each prompt alone (the first one only warms the kernels); prompt tokens per second."""
    seconds = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        engine.add_request(EngineRequest(f"prefill{len(ids)}-{i}", ids, params, lookup_prefix_cache=False,
                                         commit_prefix_cache=False))
        _sync(device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    timed = seconds[1:] or seconds
    best = min(timed)
    return {"prompt_tokens": len(prompts[0]), "seconds": best, "prefill_tok_s": len(prompts[0]) / best}


def hf_prefill(model, prompts: list[list[int]], device: torch.device) -> dict:
    """One forward over the prompt into a fresh cache, logits for the last row only."""
    seconds = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(x, logits_to_keep=1)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    timed = seconds[1:] or seconds
    best = min(timed)
    return {"prompt_tokens": len(prompts[0]), "seconds": best, "prefill_tok_s": len(prompts[0]) / best}
