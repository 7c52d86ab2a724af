"""Reference for the bookkeeping of a greedy speculative round run on the device.

A device round (``ninfer/engine/spec/device_rounds.py``) verifies, drafts and then writes
its own next inputs, all inside one CUDA graph. Around its forward passes sit three pieces
of bookkeeping: the verdict (how many drafts stand, the tokens committed, the scratch row
to keep), the drafter's inputs (positions and KV slots of the kept positions and of the
chained steps after them) and the advance (the next round's token ids, positions, KV
slots, lengths and scratch rows, and the row the host reads). As torch ops they are about
a hundred small launches a round, which on a small, launch-bound model is a tenth of the
round's device time (session 32's profile). The Triton versions do each in one launch.

``PAD`` marks a committed-token entry past the round's last token (the acceptance module's
``PAD_TOKEN``, repeated here: kernels depend on nothing in the engine).
"""

from __future__ import annotations

from typing import Optional

import torch

PAD = -1


def round_verdict(
    ids: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor, position_rows: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The greedy verdict of ``B`` verify rows of width ``w = k + 1``.

    ``ids`` int64 [B * w]: per row the last committed token, then its k drafts;
    ``num_drafts`` int64 [B]: how many of them are real; ``target`` int64 [B, w]: the
    target's argmax at each verify position; ``position_rows`` int64 [B, w] (or None): the
    scratch row each position's recurrent state went to.

    Returns ``accepted`` int64 [B] (the drafts that match the target up to the first that
    does not), ``tokens`` int64 [B, w] (those drafts, then the target's token, then PAD),
    and ``kept`` int64 [B], the scratch row of the last kept position (None without rows).
    """
    bs, w = target.shape
    k = w - 1
    drafts = ids.view(bs, w)[:, 1:]
    j = torch.arange(w, device=ids.device)
    match = (drafts == target[:, :k]) & (j[:k] < num_drafts.unsqueeze(1))
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    padded = torch.cat([drafts, drafts.new_full((bs, 1), PAD)], dim=1)
    at = accepted.unsqueeze(1)
    tokens = torch.where(j < at, padded, PAD)
    tokens = torch.where(j == at, target.gather(1, at), tokens)
    kept = None if position_rows is None else position_rows.gather(1, at).squeeze(1)
    return accepted, tokens, kept


def paged_slots(positions: torch.Tensor, tables: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 KV slots of ``positions`` [B, n] through block ``tables`` [B, cols]; -1 where a
    position lies past its row's ``pages`` [B] (it then writes no KV)."""
    page = positions // block_size
    inside = page < pages.unsqueeze(1)
    ids = tables.gather(1, page.clamp(0, tables.shape[1] - 1)).long()
    return torch.where(inside, ids * block_size + positions % block_size, -1)


def round_advance(
    tokens: torch.Tensor, accepted: torch.Tensor, drafts: torch.Tensor, input_ids: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, num_drafts: torch.Tensor,
    pages: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    position_rows: Optional[torch.Tensor] = None, bank_first: int = 0, bank_rows: int = 0,
) -> torch.Tensor:
    """Write the next round's inputs over this round's for ``B`` rows of width ``w``; returns
    int64 [B, 1 + w + k]: per row the drafts kept, the committed tokens, the next drafts.

    ``tokens``/``accepted``: :func:`round_verdict`'s; ``drafts`` int64 [B, k]: the next
    drafts. In place, for rows with pages (padding rows, ``pages == 0``, stay inert):
    ``input_ids`` [B * w] takes the target's token then the drafts (negative ids as 0),
    ``positions`` [B * w] moves past the kept tokens (its entry ``b * w`` is where row b
    started), ``slot_mapping`` [B * w] follows through ``block_tables`` [B, cols] int32,
    ``seq_lens`` [B] becomes the new end, ``num_drafts`` [B] k. With ``bank_rows``,
    ``position_rows`` [B, w] flips between the two scratch banks (rows from ``bank_first``,
    ``bank_rows`` each), so the next round writes the other one.
    """
    bs, w = tokens.shape
    k = w - 1
    live = pages > 0
    starts = positions.view(-1, w)[:bs, 0]  # (read into nxt before positions is written)
    bonus = tokens.gather(1, accepted.unsqueeze(1))
    nxt = torch.where(live, starts + accepted + 1, starts)
    new_positions = nxt.unsqueeze(1) + torch.arange(w, device=nxt.device)
    out = torch.cat([accepted.unsqueeze(1), tokens, drafts], dim=1)
    input_ids.view(-1, w)[:bs].copy_(torch.cat([bonus, drafts], dim=1).clamp_min(0))
    positions.view(-1, w)[:bs].copy_(new_positions)
    slot_mapping.view(-1, w)[:bs].copy_(paged_slots(new_positions, block_tables, pages, block_size))
    seq_lens[:bs].copy_(torch.where(live, nxt + w, seq_lens[:bs]))
    num_drafts[:bs].copy_(torch.where(live, k, 0))
    if bank_rows:
        rows = position_rows[:bs]
        other = torch.where(rows >= bank_first + bank_rows, rows - bank_rows, rows + bank_rows)
        rows.copy_(torch.where(live.unsqueeze(1), other, rows))
    return out


def draft_chain_inputs(
    tokens: torch.Tensor, accepted: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor,
    pages: torch.Tensor, block_size: int, k: int,
) -> tuple[torch.Tensor, ...]:
    """The inputs of a drafter that extends its head over a round's kept positions and then
    chains ``k - 1`` more steps (the MTP head's ``draft_after_round``).

    Row ``b`` verified ``w`` positions from ``starts[b]`` and kept ``accepted[b] + 1``
    of them, the tokens after them being ``tokens[b]`` [B, w] (PAD past the last). Returns,
    all int64: the head's token ids [B * w] (PAD as 0), positions [B * w], KV slots
    [B * w] (-1 past the kept positions or the row's pages), key counts [B] (each row
    sees keys up to its last position), the flat index of each row's last kept position
    [B], and per chained step [k - 1, B] its position, key count and KV slot.
    """
    bs, w = tokens.shape
    t = torch.arange(w, device=tokens.device)
    positions = starts.unsqueeze(1) + t
    slots = torch.where(t <= accepted.unsqueeze(1), paged_slots(positions, block_tables, pages, block_size), -1)
    lens = starts + w
    last = torch.arange(bs, device=tokens.device) * w + accepted
    chain_pos = (starts + accepted + 1).unsqueeze(0) + torch.arange(k - 1, device=tokens.device).unsqueeze(1)
    chain_slots = paged_slots(chain_pos.T, block_tables, pages, block_size).T.contiguous()
    return (tokens.clamp_min(0).reshape(-1), positions.reshape(-1), slots.reshape(-1), lens, last, chain_pos,
            chain_pos + 1, chain_slots)
