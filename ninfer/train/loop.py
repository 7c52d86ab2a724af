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
    import os
    if os.environ.get("NTRAIN_EXP") == "lr2":
        ids = {id(p) for p in model.mtp.parameters()}
        groups = [{"params": [p for p in g["params"] if id(p) not in ids], "weight_decay": g["weight_decay"], "scale": 1.0} for g in groups] + \
                 [{"params": [p for p in g["params"] if id(p) in ids], "weight_decay": g["weight_decay"], "scale": 2.0} for g in groups]
    return torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8)


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
    import os
    iso = os.environ.get("NTRAIN_EXP") == "iso"
    outs = model.mtp_chain(tokens[:, :-1], hidden[:, :-1].detach(), depth, bases=bases, isolate=iso)
    mtp = []
    for step, out in enumerate(outs, start=1):
        at = every if step == 1 else bases
        import os
        if os.environ.get("NTRAIN_EXP") == "hard":
            target = logits[:, at + step].detach().argmax(-1)
            mtp.append(F.cross_entropy(model.logits(out).flatten(0, 1), target.flatten()))
        else:
            target = logits[:, at + step].detach().softmax(-1)  # main's view of token t + step + 1
            out_logits = F.linear(out, model.lm_head.weight.detach()).float() if iso else model.logits(out)
            mtp.append(F.cross_entropy(out_logits.flatten(0, 1), target.flatten(0, 1)))
    return lm, mtp


def sample_batch(stream: torch.Tensor, preset: Preset, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - preset.seq_len, (preset.batch_size,), generator=generator)
    return torch.stack([stream[s : s + preset.seq_len] for s in starts.tolist()])


def train(model: TrainModel, stream: torch.Tensor, preset: Preset, seed: int, device: torch.device) -> dict:
    """Run ``preset.steps`` steps on token ``stream`` [N]; returns loss figures and the time taken."""
    generator = torch.Generator().manual_seed(seed + 1)
    optimizer = make_optimizer(model, preset)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start, log_every = time.perf_counter(), max(1, preset.steps // 10)
    lm_avg = mtp_avg = None
    for step in range(preset.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, preset) * group.get("scale", 1.0)
        tokens = sample_batch(stream, preset, generator).to(device)
        with autocast:
            lm, mtp = losses(model, tokens, preset, offset=step)
            loss = lm + preset.mtp_weight * sum(mtp)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lm_now, mtp_now = lm.item(), [m.item() for m in mtp]
        lm_avg = lm_now if lm_avg is None else 0.9 * lm_avg + 0.1 * lm_now
        mtp_avg = mtp_now if mtp_avg is None else [0.9 * a + 0.1 * b for a, b in zip(mtp_avg, mtp_now)]
        if (step + 1) % log_every == 0 or step + 1 == preset.steps:
            logger.info("step {}/{}: lm loss {:.3f}, mtp loss {} ({:.0f} s)", step + 1, preset.steps, lm_avg,
                        " ".join(f"{m:.3f}" for m in mtp_avg), time.perf_counter() - start)
    model.eval()
    return {"train_seconds": time.perf_counter() - start, "final_lm_loss": lm_avg, "final_mtp_loss": mtp_avg}
