"""What one speculative round costs on a loaded engine, at a given context length.

Three device times, each replayed back to back on the same sequence: a plain decode step
(its CUDA graph at batch 1, then the LM head and an argmax), a verify step of ``k + 1``
rows (its verify graph, the LM head over its rows and an argmax, and for recurrent state
the copy of the kept position's state back into the working slot), and the proposer's
drafting of ``k`` tokens after a step. With per-position acceptance
rates ``a_1..a_k`` a round commits ``1 + a_1 + a_1 a_2 + ...`` tokens on average, so the
speedup over plain decode is that expectation times ``decode / (verify + draft)``. The
figure reports that for the acceptance given, which is how a random-weight shape's cost
combines with a trained model's acceptance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from ninfer.bench.bandwidth import cuda_ms
from ninfer.engine.request import EngineRequest
from ninfer.engine.spec.proposer import StepRecord
from ninfer.sampling_params import SamplingParams


def acceptance_arg(value: str) -> tuple[list[float], str]:
    """``--spec-acceptance``: conditional rates ``a_1,a_2,...`` (draft ``j`` kept given drafts
    ``1..j-1`` were), or the path of a ``ninfer-train`` report, whose round replay gives the
    shares ``c_j`` of rounds that kept drafts ``1..j`` (so ``a_j = c_j / c_(j-1)``). Returns the
    rates and where they came from."""
    path = Path(value)
    if not path.is_file():
        return [float(a) for a in value.split(",")], "given"
    report = json.loads(path.read_text(encoding="utf-8"))
    key = "round_acceptance_per_position" if "round_acceptance_per_position" in report else "acceptance_per_position"
    shares, rates, before = report[key], [], 1.0
    for share in shares:
        rates.append(share / before if before > 0 else 0.0)
        before = share
    return rates, f"{path} ({key})"


def expected_tokens(acceptance: Sequence[float]) -> float:
    """Tokens a round commits on average: the target's own plus each draft reached and kept."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


def round_cost(engine, context: int, acceptance: Sequence[float], vocab: int, repeats: int = 20) -> dict:
    """Decode, verify and draft milliseconds for one sequence at ``context`` tokens."""
    k = engine.config.draft_tokens
    if not k or engine.runner.verify_graphs is None or engine.runner.graphs is None:
        raise RuntimeError("the round cost needs CUDA graphs and a speculative backend (--spec, --draft-tokens)")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    engine.add_request(EngineRequest("spec-cost", prompt, SamplingParams(temperature=0, max_tokens=64,
                                                                           ignore_eos=True), speculate=False))
    while engine.scheduler.num_decode_ready < 1:
        engine.step()
    seq = engine.scheduler.running[0]
    slot = [seq.state_slot] if seq.state_slot is not None else None
    pos = seq.num_computed_tokens
    head = engine.model.compute_logits
    decode = engine.runner.graphs
    bucket = decode.stage_inputs([seq.token_ids[pos]], [pos], [seq.block_table], slot)
    if decode.has_head(bucket):  # the replay runs the head and its argmax itself
        decode_ms = cuda_ms(lambda: decode.replay(bucket), repeats)
    else:
        decode_ms = cuda_ms(lambda: head(_replayed(decode, bucket)[:1]).argmax(-1), repeats)
    verify = engine.runner.verify_graphs
    ids = [seq.token_ids[pos]] + prompt[:k]
    vbucket = verify.stage_inputs(ids, [pos], [seq.block_table], slot)
    verify_ms = cuda_ms(lambda: head(_replayed(verify, vbucket)[: k + 1]).argmax(-1), repeats)
    if slot is not None:  # the round then copies the kept position's state back (all of it, at worst)
        scratch = engine.runner.scratch
        verify_ms += cuda_ms(lambda: scratch.settle(slot, [k]), repeats)
    draft_ms = _draft_ms(engine, seq, repeats)
    engine.abort_request("spec-cost")
    tokens = expected_tokens(list(acceptance)[:k])
    return {
        "context": context, "draft_tokens": k, "decode_step_ms": decode_ms, "verify_step_ms": verify_ms,
        "verify_over_decode": verify_ms / decode_ms, "draft_ms": draft_ms, "draft_ms_per_token": draft_ms / k,
        "acceptance_assumed": list(acceptance)[:k], "tokens_per_round": tokens,
        "implied_speedup": tokens * decode_ms / (verify_ms + draft_ms),
    }


def _replayed(graphs, bucket: int) -> torch.Tensor:
    graphs.replay(bucket)
    return graphs.output(bucket)


def _draft_ms(engine, seq, repeats: int) -> float:
    """Milliseconds the proposer spends after a plain decode step of ``seq`` (0 without a draft model)."""
    proposer = engine.proposer
    if not getattr(proposer, "needs_hidden", False):
        return 0.0
    hidden_size = engine.model.lm_head.weight.shape[1]
    hidden = torch.randn(1, hidden_size, dtype=engine.model.lm_head.weight.dtype, device=engine.device)
    chunk = type("Chunk", (), {"seq": seq})()
    record = StepRecord([chunk], [seq.num_computed_tokens - 1], [0], [1], hidden)
    for _ in range(2):
        proposer.after_step(record)
    torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(repeats):
        proposer.after_step(record)
    torch.cuda.synchronize(engine.device)
    return 1000 * (time.perf_counter() - start) / repeats
