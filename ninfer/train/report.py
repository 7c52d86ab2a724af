"""What a run reports: held-out perplexity and greedy MTP draft acceptance.

Acceptance is measured the way greedy speculative decoding would see it. Prompts are
windows of the held-out token stream; the main model continues each greedily; then, at
every base position ``t`` of the continuation, the MTP chained ``k`` times drafts tokens
``t + 2 .. t + k + 1`` (step 1 from the main hidden state at ``t`` and token ``t + 1``, later
steps from their own drafts) and a draft counts as accepted when it and all drafts before
it equal what greedy decoding produced. ``acceptance_per_position[j]`` is the share of
bases whose first ``j + 1`` drafts were accepted (vLLM's per-position rate, were a round
to start at every base); their sum is the mean accepted length.

``round_acceptance_per_position`` counts the same drafts only at the bases an engine's
rounds start from: the first after the prompt, each next one after the previous round's
kept drafts and bonus token. That is the figure ``ninfer-bench --spec mtp`` and the
server's log report on the same prompts, and ``tokens_per_round`` (its sum plus one) is
what a round commits. The two differ by a few hundredths (rounds start right after
rejections, which cluster), but only this one is what an engine sees.

``teacher_forced_agreement`` is the same count on held-out text itself, the chain fed the
true tokens: how often draft ``j`` equals the main model's greedy choice after the true
prefix. It does not depend on the model's own (often repetitive) continuations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninfer.train.model import TrainModel
from ninfer.train.presets import Preset


def windows(stream: torch.Tensor, length: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [count, length] of ``stream``, evenly spread when ``count`` is given."""
    total = len(stream) // length
    if count is None or count >= total:
        return stream[: total * length].reshape(total, length)
    picks = torch.linspace(0, total - 1, count).long()
    return stream[: total * length].reshape(total, length)[picks]


def _accepted(drafts: list[torch.Tensor], targets: list[torch.Tensor]) -> list[float]:
    """Per position: share of rows whose drafts 1..j all match their targets."""
    run = torch.ones_like(drafts[0], dtype=torch.bool)
    rates = []
    for d, t in zip(drafts, targets):
        run = run & (d == t)
        rates.append(run.float().mean().item())
    return rates


@torch.no_grad()
def greedy_continue(model: TrainModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of ``prompts`` [B, P] by ``new_tokens``, decoding from the layers'
    states (:meth:`TrainModel.hidden` with a cache) as an engine does; returns [B, P + new_tokens]."""
    cache: list[dict] = [{} for _ in model.text.layers]
    hidden = model.hidden(prompts, cache)
    seq = [prompts]
    for i in range(new_tokens):
        nxt = model.logits(hidden[:, -1]).argmax(-1)[:, None]
        seq.append(nxt)
        if i + 1 < new_tokens:
            hidden = model.hidden(nxt, cache, start=prompts.shape[1] + i)
    return torch.cat(seq, dim=1)


@torch.no_grad()
def chain_drafts(model: TrainModel, seq: torch.Tensor, depth: int) -> torch.Tensor:
    """The greedy drafts of the MTP chained ``depth`` times at every base ``t`` of ``seq``
    [B, L] (step 1 from the hidden state at ``t`` and token ``t + 1``, later steps from
    their own drafts): [B, L - 1 - depth, depth], entry ``[b, t, j]`` drafting token
    ``t + j + 2``. What a greedy engine's rounds must draft at the same base."""
    hidden = model.hidden(seq)
    outs = model.mtp_chain(seq[:, :-1], hidden[:, :-1], depth, drafts=True)
    return torch.stack([model.logits(out).argmax(-1) for out in outs], dim=2)


def every_base_acceptance(drafts: torch.Tensor, seq: torch.Tensor, prompt_len: int) -> list[float]:
    """Acceptance per position at every base of the continuation of ``seq`` [B, L] past
    ``prompt_len`` (``drafts`` [B, bases, k] from :func:`chain_drafts`)."""
    depth = drafts.shape[2]
    first = prompt_len - 1  # base t = prompt_len - 1: token t + 1 is the first greedy one
    drafts = drafts[:, first:]
    n = first + drafts.shape[1]
    targets = [seq[:, first + j + 1 : n + j + 1] for j in range(1, depth + 1)]
    return _accepted([drafts[..., j] for j in range(depth)], targets)


def round_acceptance(drafts: torch.Tensor, seqs: torch.Tensor, prompt_len: int) -> dict:
    """Replay the greedy rounds over continuations ``seqs`` [B, L] with the chain's drafts at
    every base (``drafts`` [B, bases, k] from :func:`chain_drafts`): per-position acceptance
    over the rounds an engine would run, tokens a round, and the round count."""
    k = drafts.shape[2]
    rows, seqs = drafts.tolist(), seqs.tolist()
    kept, rounds, committed = [0] * k, 0, 0
    for row, seq in zip(rows, seqs):
        base = prompt_len - 1  # the first round drafts after the prefill's token
        while base + k + 1 < len(seq):
            accepted = 0
            while accepted < k and row[base][accepted] == seq[base + accepted + 2]:
                kept[accepted] += 1
                accepted += 1
            rounds += 1
            committed += accepted + 1
            base += accepted + 1
    return {"position_acceptance": [n / max(rounds, 1) for n in kept],
            "tokens_per_round": committed / max(rounds, 1), "rounds": rounds}


@torch.no_grad()
def heldout_figures(model: TrainModel, stream: torch.Tensor, preset: Preset, device: torch.device) -> dict:
    """Perplexity and teacher-forced MTP agreement over the whole held-out stream."""
    depth, nll, count = preset.mtp_depth, 0.0, 0
    matches = [0.0] * depth
    rows = 0
    for batch in windows(stream, preset.seq_len).to(device).split(preset.batch_size):
        hidden = model.hidden(batch)
        logits = model.logits(hidden)
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
        outs = model.mtp_chain(batch[:, :-1], hidden[:, :-1], depth)
        n = outs[0].shape[1]
        greedy = logits.argmax(-1)
        drafts = [model.logits(o).argmax(-1) for o in outs]
        targets = [greedy[:, j : j + n] for j in range(1, depth + 1)]
        size = drafts[0].numel()
        for j, rate in enumerate(_accepted(drafts, targets)):
            matches[j] += rate * size
        rows += size
    return {
        "heldout_tokens": count,
        "heldout_loss": nll / count,
        "perplexity": math.exp(nll / count),
        "teacher_forced_agreement": [m / rows for m in matches],
    }


def evaluate(model: TrainModel, stream: torch.Tensor, preset: Preset, device: torch.device) -> dict:
    model.eval()
    figures = heldout_figures(model, stream, preset, device)
    prompts = windows(stream, preset.eval_prompt_len, preset.eval_prompts).to(device)
    seqs = [greedy_continue(model, chunk, preset.eval_new_tokens) for chunk in prompts.split(preset.eval_batch)]
    drafts = torch.cat([chain_drafts(model, seq, preset.mtp_depth) for seq in seqs])
    seqs = torch.cat(seqs)
    rates = every_base_acceptance(drafts, seqs, preset.eval_prompt_len)
    rounds = round_acceptance(drafts, seqs, preset.eval_prompt_len)
    mean_len = sum(rates)
    return {
        **figures,
        "draft_tokens": preset.mtp_depth,
        "acceptance_per_position": rates,
        "mean_accepted_length": mean_len,
        "acceptance_rate": mean_len / preset.mtp_depth,
        "round_acceptance_per_position": rounds["position_acceptance"],
        "tokens_per_round": rounds["tokens_per_round"],
        "eval_prompts": len(prompts),
        "eval_prompt_tokens": preset.eval_prompt_len,
        "eval_new_tokens": preset.eval_new_tokens,
    }
