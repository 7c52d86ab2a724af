"""The optimisation loop: LM loss plus the chained MTP losses, AdamW, warm-up then cosine.

The MTP steps learn what the main model will say, not the corpus: step ``j``'s target is
the main model's own (detached) distribution at position ``t + j``, which is exactly what
a draft must match for the verifier to accept it. The MTP reads the main hidden states
detached too, so its loss never bends the main model; the embedding and LM head, which
the MTP shares, still learn from it.

Everything random draws from generators seeded by ``seed`` (the initial weights from
torch's global one, batches from their own), so a run repeats exactly on the same machine
with the same thread count.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from loguru import logger

from ninfer.train.model import TrainModel
from ninfer.train.presets import Preset


def lr_at(step: int, preset: Preset) -> float:
    if step < preset.warmup:
        return preset.lr * (step + 1) / preset.warmup
    progress = (step - preset.warmup) / max(1, preset.steps - preset.warmup)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: TrainModel, preset: Preset) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    groups = [{"params": decay, "weight_decay": preset.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # the fused kernel on a GPU (one launch for all tensors); on a CPU torch's default
    fused = True if next(model.parameters()).device.type == "cuda" else None
    return torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def losses(
    model: TrainModel, tokens: torch.Tensor, preset: Preset, offset: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """LM cross-entropy and each MTP step's distillation loss for a batch [B, L].

    Chained steps from 2 on train at every ``preset.mtp_stride``-th base from ``offset``
    (step 1 at all): they cost a full layer and LM head each, and matter less.
    """
    hidden = model.hidden(tokens)
    logits = model.logits(hidden)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    depth = preset.mtp_depth
    n = tokens.shape[1] - 1 - depth
    every = torch.arange(n, device=tokens.device)
    bases = every[offset % preset.mtp_stride :: preset.mtp_stride]
    outs = model.mtp_chain(tokens[:, :-1], hidden[:, :-1].detach(), depth, bases=bases)
    mtp = []
    for step, out in enumerate(outs, start=1):
        at = every if step == 1 else bases
        target = logits[:, at + step].detach().softmax(-1)  # main's view of token t + step + 1
        mtp.append(F.cross_entropy(model.logits(out).flatten(0, 1), target.flatten(0, 1)))
    return lm, mtp


def batch_starts(stream_len: int, preset: Preset, seed: int) -> torch.Tensor:
    """Every step's window starts [steps, batch], drawn up front from their own generator."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, stream_len - preset.seq_len, (preset.steps, preset.batch_size), generator=generator)


def train(model: TrainModel, stream: torch.Tensor, preset: Preset, seed: int, device: torch.device) -> dict:
    """Run ``preset.steps`` steps on token ``stream`` [N]; returns loss figures and the time taken.

    The stream and the batch plan live on ``device``, and the running losses stay there
    too, read back only when logged: no host round trip in the loop."""
    optimizer = make_optimizer(model, preset)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    stream = stream.to(device)
    starts = batch_starts(len(stream), preset, seed).to(device)
    window = torch.arange(preset.seq_len, device=device)
    model.train()
    start, log_every = time.perf_counter(), max(1, preset.steps // 10)
    running = None  # [lm, mtp 1..depth], exponential moving averages
    for step in range(preset.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, preset)
        tokens = stream[starts[step, :, None] + window]
        with autocast:
            lm, mtp = losses(model, tokens, preset, offset=step)
            loss = lm + preset.mtp_weight * sum(mtp)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        now = torch.stack([lm.detach(), *(m.detach() for m in mtp)]).float()
        running = now if running is None else running.lerp(now, 0.1)
        if (step + 1) % log_every == 0 or step + 1 == preset.steps:
            lm_avg, *mtp_avg = running.tolist()
            logger.info("step {}/{}: lm loss {:.3f}, mtp loss {} ({:.0f} s)", step + 1, preset.steps, lm_avg,
                        " ".join(f"{m:.3f}" for m in mtp_avg), time.perf_counter() - start)
    lm_avg, *mtp_avg = running.tolist()  # waits for the device to finish
    model.eval()
    return {"train_seconds": time.perf_counter() - start, "final_lm_loss": lm_avg, "final_mtp_loss": mtp_avg}
