"""Compiling kernels before the first request does.

Triton compiles a kernel per distinct set of compile-time values, and it specialises
integer arguments on their value (1, multiples of 16, anything else). Block shapes come
from tuned tables keyed by the step's token count (the MoE kernels' entries double from
1 to 8,192 tokens), and long steps take other paths (the MoE layout's grid launches past
1,024 pairs). A fresh server would pay those compiles inside the first requests of each
new shape: on an H100, the first 8k prompt beside running decodes stalled them for 11 s.
Before serving, the engine therefore runs throwaway requests: short prompts of assorted
lengths alone and together (prefill, mixed and decode steps), then prompts that double
from 64 tokens up to the prefill chunk, each a token short of a power of two and at it,
then a whole chunk beside a short prompt (the largest step), then a prompt whose later
chunks continue it (their own kernel variants) beside one that decodes meanwhile. An
engine that speculates also admits prompts while a request verifies its drafts at the
engine's full width: that step mixes verify rows with a prefill chunk, which no graph
holds, so its kernels run as launched, with variants of their own (in session 38's
bench, eager verify variants compiled while serving took 2.5-5 s each). They neither read nor
publish cached prefixes, so the recurrent-state snapshot copy runs once on its own (a row
onto itself), and the engine's counters start from zero afterwards.
:mod:`.compile_watch` names any compile the warm-up missed.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from loguru import logger

from ninfer.engine.compile_watch import CompileWatch
from ninfer.engine.request import EngineRequest
from ninfer.sampling_params import SamplingParams

#: prompt lengths covering Triton's integer specialisations (1, a multiple of 16, neither)
PROMPT_LENGTHS = (1, 2, 7, 16, 33)
#: the shortest of the long prompts; they double from here up to the prefill chunk
LONG_FROM = 64


def keep_autotuning_results() -> None:
    """Have Triton keep its autotuners' choices on disk beside the compiled kernels
    (``TRITON_CACHE_AUTOTUNING``) unless the user set it: flash-linear-attention autotunes
    its chunked kernels at their first call by timing every candidate, and without the
    cache each server start times them all again, where the compiled kernels themselves
    are already cached."""
    if "TRITON_CACHE_AUTOTUNING" not in os.environ:
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"


def warm_up_rounds(chunk: int, max_concurrency: int, limit: int, pool: int, out: int) -> list[list[int]]:
    """The prompt lengths of each round (a round's prompts run together), for prompts of at
    most ``limit`` tokens and rounds of at most ``pool`` tokens (the KV pool's), ``out``
    output tokens each: the short lengths alone, then together; each long length alone; then a
    whole chunk beside a two-token prompt."""
    short = [n for n in PROMPT_LENGTHS if n <= limit]
    top = min(chunk, limit)
    long: list[int] = []
    p = LONG_FROM
    while p <= top:
        long += [p - 1, p]
        p *= 2
    if top >= LONG_FROM and top not in long:  # a chunk that is no power of two
        long += [top - 1, top]
    rounds = [[n] for n in short + long]
    if max_concurrency > 1:
        rounds.append(short[:max_concurrency])
        if top >= LONG_FROM and top + 2 + 2 * out <= pool:
            rounds.append([top, 2])
    return rounds


def continued_round(chunk: int, limit: int) -> tuple[int, int]:
    """``(prompt, chunk)``: a prompt prefilled in two whole chunks and one token, so later
    chunks continue a sequence (recurrent state and convolution taps carried in, attention
    over earlier chunks: kernels and autotuned variants of their own). The engine's chunk
    where the context allows twice it, else a third of the longest prompt."""
    step = chunk if 2 * chunk + 1 <= limit else max(1, limit // 3)
    return min(limit, 2 * step + 1), step


def warm_up(engine, token_id: int = 0, watch: Optional[CompileWatch] = None) -> float:
    """Run the throwaway requests to completion; returns the seconds it took. ``watch``
    (installed, quiet: the builder keeps it so from the engine's start): its compiles are
    counted in the log line, and it warns of later ones."""
    started = time.perf_counter()
    before = (watch.compiles, watch.seconds, dict(watch.by_kernel)) if watch is not None else (0, 0.0, {})
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cfg = engine.config
    pool = engine.num_blocks * cfg.block_size
    limit = min(cfg.max_context, pool) - params.max_tokens
    rounds = warm_up_rounds(cfg.prefill_chunk, cfg.max_concurrency, limit, pool, params.max_tokens)
    admissions = speculative_admissions(cfg, limit, pool)
    progress = _Progress(len(rounds) + 1 + len(admissions), watch)
    for i, batch in enumerate(rounds):
        _run(engine, f"warmup-{i}", batch, params, token_id)
        progress.done()
    continued, chunk = continued_round(cfg.prefill_chunk, limit)
    # beside a short request that decodes while the long one's later chunks run (mixed steps)
    companion = [2] if cfg.max_concurrency > 1 and continued + 2 + 2 * params.max_tokens <= pool else []
    engine.scheduler.set_prefill_chunk(chunk)
    try:
        _run(engine, "warmup-continued", [continued, *companion], params, token_id)
    finally:
        engine.scheduler.set_prefill_chunk(cfg.prefill_chunk)
    rounds.append([continued, *companion])
    progress.done()
    for n in admissions:
        _verify_beside_prefill(engine, n, token_id)
        rounds.append([1, n])
        progress.done()
    if engine.scheduler.snapshots is not None:  # the throwaway requests take no snapshots
        engine.scheduler.snapshots.warm_up()
    engine.reset_stats()
    seconds = time.perf_counter() - started
    compiled = ""
    if watch is not None:
        watch.serving = True
        compiled = f", {watch.compiles - before[0]} Triton compiles ({watch.seconds - before[1]:.1f} s)"
        if watch.compiles > before[0]:
            compiled += f"; longest: {watch.heaviest(before[2])}"
    logger.info("warmed up kernels with {} throwaway requests (prompts up to {} tokens) in {:.1f} s{}",
                sum(map(len, rounds)), max(map(max, rounds)), seconds, compiled)
    return seconds


#: seconds between the warm-up's progress lines (a cold Triton cache makes it a minute or more)
PROGRESS_S = 10.0


class _Progress:
    """Says the warm-up has begun, then every :data:`PROGRESS_S` seconds how far it got and
    how many kernels it compiled, so a first start on a machine does not look hung."""

    def __init__(self, total: int, watch: Optional[CompileWatch]):
        self.total, self.watch, self.finished = total, watch, 0
        self.started = self.last = time.perf_counter()
        self.compiles = watch.compiles if watch is not None else 0
        logger.info("warming up kernels: {} rounds of throwaway requests before serving", total)

    def done(self) -> None:
        self.finished += 1
        now = time.perf_counter()
        if now - self.last < PROGRESS_S or self.finished == self.total:
            return
        self.last = now
        compiled = f", {self.watch.compiles - self.compiles} Triton compiles so far" if self.watch is not None else ""
        logger.info("warm-up: {} of {} rounds in {:.0f} s{}", self.finished, self.total, now - self.started, compiled)


def speculative_admissions(cfg, limit: int, pool: int) -> list[int]:
    """Prompt lengths admitted beside a verifying request when the engine speculates, each
    filling its pages exactly (two output tokens and the speculative slack included), so
    the step's block table is 3, 16 and 1 pages wide: Triton specialises the table's row
    stride on 1 and on multiples of 16. The verifying request holds one page where it can."""
    k, bs = cfg.draft_tokens, cfg.block_size
    if not k or cfg.max_concurrency < 2:
        return []
    verifier = 1 + _verifier_tokens(k) + k
    out = []
    for pages in (3, 16, 1):
        n = pages * bs - 2 - k
        if n >= 1 and n + 2 <= limit and -(-verifier // bs) <= pages and verifier + pages * bs <= pool:
            out.append(n)
    return out


def _verifier_tokens(k: int) -> int:
    """The verifying request's output: its full draft count still left two rounds in (a
    round or two may have run ahead by the time the other request is admitted)."""
    return k + 5


def _verify_beside_prefill(engine, prompt: int, token_id: int) -> None:
    """A one-token request that drafts the engine's full count, then a ``prompt``-token one
    admitted while it verifies; both run out."""
    long = SamplingParams(temperature=0, max_tokens=_verifier_tokens(engine.config.draft_tokens), ignore_eos=True)
    engine.add_request(_throwaway("warmup-spec-0", 1, long, token_id))
    for _ in range(2):  # the prompt, then a step whose hidden state the drafts come from
        engine.step()
    engine.add_request(_throwaway("warmup-spec-1", prompt, SamplingParams(temperature=0, max_tokens=2,
                                                                          ignore_eos=True), token_id))
    while engine.has_unfinished():
        engine.step()


def _throwaway(request_id: str, n: int, params: SamplingParams, token_id: int) -> EngineRequest:
    """An ``n``-token request that neither reads nor publishes cached prefixes."""
    return EngineRequest(request_id, [token_id] * n, params, lookup_prefix_cache=False, commit_prefix_cache=False)


def _run(engine, tag: str, lengths: list[int], params: SamplingParams, token_id: int) -> None:
    for j, n in enumerate(lengths):
        engine.add_request(_throwaway(f"{tag}-{j}", n, params, token_id))
    while engine.has_unfinished():
        engine.step()
