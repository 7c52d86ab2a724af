"""Compiling kernels before the first request does.

Triton compiles a kernel per distinct set of compile-time values, and it specialises
integer arguments on their value (1, multiples of 16, anything else). A fresh server
would pay those compiles (up to a second each on an H200) inside the first requests of
each new shape. Before serving, the engine therefore runs a few throwaway requests of
assorted prompt lengths, alone and together, so prefill, mixed and decode steps have
compiled what they need. They neither read nor publish cached prefixes, and the engine's
counters start from zero afterwards.
"""

from __future__ import annotations

import os
import time

from loguru import logger

from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams

#: prompt lengths covering Triton's integer specialisations (1, a multiple of 16, neither)
PROMPT_LENGTHS = (1, 2, 7, 16, 33)


def keep_autotuning_results() -> None:
    """Have Triton keep its autotuners' choices on disk beside the compiled kernels
    (``TRITON_CACHE_AUTOTUNING``) unless the user set it: flash-linear-attention autotunes
    its chunked kernels at their first call by timing every candidate, and without the
    cache each server start times them all again, where the compiled kernels themselves
    are already cached."""
    if "TRITON_CACHE_AUTOTUNING" not in os.environ:
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"


def warm_up(engine, token_id: int = 0) -> float:
    """Run the throwaway requests to completion; returns the seconds it took."""
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    lengths = [n for n in PROMPT_LENGTHS if n + params.max_tokens <= engine.config.max_context]
    rounds = [[n] for n in lengths] + [lengths[: engine.config.max_concurrency]]  # alone, then together
    for i, batch in enumerate(rounds):
        for j, n in enumerate(batch):
            engine.add_request(EngineRequest(f"warmup-{i}-{j}", [token_id] * n, params,
                                             lookup_prefix_cache=False, commit_prefix_cache=False))
        while engine.has_unfinished():
            engine.step()
    engine.reset_stats()
    seconds = time.perf_counter() - started
    logger.info("warmed up kernels with {} throwaway requests in {:.1f} s", sum(map(len, rounds)), seconds)
    return seconds
