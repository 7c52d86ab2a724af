"""On-device token sampling, free of host syncs.

Per step: add logit bias, apply the repetition penalty (prompt and output tokens), then
presence/frequency penalties (output tokens); greedy rows take the argmax of that. Random
rows divide by their temperature, drop tokens below min_p of the top probability, keep
their top_k best and the smallest head holding top_p of the mass, then draw with the
Gumbel-max trick.

The noise for a row is a pure function of (seed, output position, token id), computed by
a counter-based integer hash on the device. A seeded request therefore draws the same
tokens whatever shares its batch, and the token a row draws does not depend on whether
the filters ran over the whole vocabulary or over a ranked top-k slice.

Rows that may not end yet (fewer than ``min_tokens`` outputs, or a guide that cannot
end) lose their stop tokens, and guided rows every token their guide forbids (after the
penalties, so greedy and random rows alike choose among the allowed tokens only).

Log probabilities describe the model's distribution with the logit bias applied, before
penalties, temperature, filters, stop bans and guide masks: ``log_softmax(logits + bias)``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ninfer.engine.sampling_metadata import SamplingMetadata, TokenMask

# splitmix64 constants, as signed 64-bit values (torch has no unsigned 64-bit arithmetic)
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_A = 0xBF58476D1CE4E5B9 - 2**64
_MIX_B = 0x94D049BB133111EB - 2**64
#: uniform draws keep 52 random bits so ``bits + 0.5`` is exact in float64
_UNIFORM_BITS = 52


@attrs.frozen(eq=False)
class SamplerOutput:
    """``token_ids``: int64 [B]. With logprobs: the sampled token's log probability [B] and
    the K most likely tokens per row, best first ([B, K]; K = the largest request)."""

    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


class Sampler:
    """Turns a step's float32 logits ``[B, V]`` into one token per row."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match metadata ({meta.num_rows}, {meta.vocab_size})")
        logits = apply_logit_bias(logits.float(), meta)
        base_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        token_ids = select_tokens(apply_constraints(logits, meta), meta)
        if base_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        top_logprobs, top_ids = base_logprobs.topk(meta.max_num_logprobs, dim=-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=base_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
        )


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``logits`` plus each row's sparse logit bias (the distribution logprobs describe)."""
    if meta.bias_rows is None:
        return logits
    return logits.index_put((meta.bias_rows, meta.bias_token_ids), meta.bias_values, accumulate=True)


def apply_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Biased logits -> the logits every row chooses from: penalties, then stop bans and
    guide masks. Shared by :class:`Sampler` and speculative verification
    (:mod:`ninfer.engine.spec`), so both see one processing of the same row."""
    logits = _apply_penalties(logits, meta)
    if meta.banned_stops is not None:
        # one flat index per (row, stop token): a scatter, whatever the vocabulary size
        logits = logits.reshape(-1).index_fill(0, meta.banned_stops, -torch.inf).view_as(logits)
    if meta.token_mask is not None:
        logits = apply_token_mask(logits, meta.token_mask)
    return logits


def select_tokens(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    candidates: Optional[Candidates] = None,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """int64 [B]: the token each row takes from its constrained logits: the argmax for
    greedy rows, a Gumbel-max draw on the row's own (seed, position) stream from the
    filtered candidates for random ones (``candidates``: :func:`filter_candidates`'s
    result when the caller already has it). ``rows`` int64 [N]: only those rows' tokens
    ([N]), drawing noise for them alone (speculative verification needs one of k+1)."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    if meta.all_greedy:
        return pick(logits).argmax(dim=-1)
    if candidates is None:
        candidates = filter_candidates(logits, meta)
    if rows is not None:
        ids = candidates.token_ids
        candidates = Candidates(pick(candidates.values), None if ids is None else pick(ids))
    token_ids = draw_candidates(candidates, row_keys(pick(meta.seeds), pick(meta.positions)))
    if meta.greedy_mask is not None:
        token_ids = torch.where(pick(meta.greedy_mask), pick(logits).argmax(dim=-1), token_ids)
    return token_ids


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.repetition_mask is not None:
        # shrink seen tokens towards "less likely" whatever the sign of their logit
        rp = meta.repetition_penalty
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(meta.repetition_mask, penalised, logits)
    if meta.output_counts is not None:
        counts = meta.output_counts
        logits = logits - meta.frequency_penalty * counts - meta.presence_penalty * (counts > 0)
    return logits


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """``logits`` with the tokens each guided row may not take set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask.bitmask.unsqueeze(-1) >> shifts) & 1  # [G, words, 32]: arithmetic shift is fine for one bit
    allowed = bits.flatten(1)[:, : logits.shape[-1]].bool()
    guided = logits.index_select(0, mask.rows).masked_fill(~allowed, -torch.inf)
    return logits.index_copy(0, mask.rows, guided)


@attrs.frozen(eq=False)
class Candidates:
    """What a random row draws from: ``values`` are its filtered, temperature-scaled logits
    (-inf = dropped); ``token_ids`` their ids, ``[B, C]`` ranked best first, or None when
    ``values`` span the whole vocabulary in id order (no ranking was needed)."""

    values: torch.Tensor
    token_ids: Optional[torch.Tensor]


def filter_candidates(logits: torch.Tensor, meta: SamplingMetadata) -> Candidates:
    """Temperature, min_p, top_k and top_p on constrained logits (random rows only)."""
    if meta.top_k is None and meta.top_p is None:
        # no ranking needed: filter over the vocabulary in place
        scaled = logits if meta.temperature is None else logits / meta.temperature
        if meta.log_min_p is not None:
            floor = scaled.amax(dim=-1, keepdim=True) + meta.log_min_p
            scaled = scaled.masked_fill(scaled < floor, -torch.inf)
        return Candidates(scaled, None)

    # Ranked candidates, best first. Temperature preserves the order, so it is applied to
    # the candidates only.
    if meta.candidate_width < meta.vocab_size:
        values, token_ids = logits.topk(meta.candidate_width, dim=-1)
    else:
        values, token_ids = logits.sort(dim=-1, descending=True, stable=True)
    if meta.temperature is not None:
        values = values / meta.temperature
    if meta.log_min_p is not None:
        values = values.masked_fill(values < values[:, :1] + meta.log_min_p, -torch.inf)
    if meta.top_k is not None:
        rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
        values = values.masked_fill(rank >= meta.top_k, -torch.inf)
    if meta.top_p is not None:
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the best token
        values = values.masked_fill(mass_before >= meta.top_p, -torch.inf)
    return Candidates(values, token_ids)


def draw_candidates(candidates: Candidates, keys: torch.Tensor) -> torch.Tensor:
    """int64 [B]: a Gumbel-max draw from ``softmax(candidates.values)`` per row, with the
    noise of token id t taken from ``keys`` and t alone (not from its rank)."""
    values, token_ids = candidates.values, candidates.token_ids
    if token_ids is None:
        ids = torch.arange(values.shape[-1], device=values.device).unsqueeze(0)
        return (values + gumbel_noise(keys, ids)).argmax(dim=-1)
    choice = (values + gumbel_noise(keys, token_ids)).argmax(dim=-1, keepdim=True)
    return token_ids.gather(1, choice).squeeze(1)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """int64 (the shape of ``seeds + positions``): one hash key per (seed, output position).

    ``stream`` 0 is the sampler's own; any other value keys an unrelated stream for the
    same (seed, position), so speculative verification's accept tests and residual draws
    stay independent of the proposals and of each other."""
    keys = _mix64(_mix64(seeds) + positions)
    return keys if stream == 0 else _mix64(keys ^ stream)


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64, open interval (0, 1): entry ``[b, j]`` depends only on ``keys[b]`` and
    ``token_ids[b, j]`` (``token_ids`` may be ``[1, C]`` to share ids across rows)."""
    # token id j reads element j + 1 of the splitmix64 stream that starts at the key
    h = _mix64(keys.unsqueeze(1) + (token_ids + 1) * _GOLDEN_GAMMA)
    bits = _shift_right(h, 64 - _UNIFORM_BITS)
    return (bits.double() + 0.5) * 2.0**-_UNIFORM_BITS


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 standard Gumbel noise; ``argmax(logits + noise)`` samples ``softmax(logits)``."""
    return (-torch.log(-torch.log(uniform_noise(keys, token_ids)))).float()


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX_A
    z = (z ^ _shift_right(z, 27)) * _MIX_B
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift: torch shifts signed integers arithmetically, so clear the sign fill."""
    return (z >> n) & ((1 << (64 - n)) - 1)
