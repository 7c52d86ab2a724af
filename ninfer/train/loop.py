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
import os
import time

import torch
import torch.nn.functional as F
from loguru import logger

from ninfer.train.graphed_step import GraphedStep, capturable
from ninfer.train.model import TrainModel
from ninfer.train.presets import Preset


def lr_at(step: int, preset: Preset, steps: int | None = None) -> float:
    """The learning rate at ``step`` of a run of ``steps`` (the preset's unless a time budget cut it)."""
    steps = preset.steps if steps is None else steps
    if step < preset.warmup:
        return preset.lr * (step + 1) / preset.warmup
    progress = (step - preset.warmup) / max(1, steps - preset.warmup)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: TrainModel, preset: Preset, graphed: bool = False) -> torch.optim.Optimizer:
    """AdamW; ``graphed``: for a captured step (learning rates and step counts on the device)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    device = next(model.parameters()).device
    groups = [{"params": decay, "weight_decay": preset.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if graphed:  # fused AdamW reads each group's rate from the device, where the loop fills it
        for group in groups:
            group["lr"] = torch.tensor(preset.lr, device=device)
    # the fused kernel on a GPU (one launch for all tensors); on a CPU torch's default
    fused = True if device.type == "cuda" else None
    return torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused, capturable=graphed)


def mtp_bases(n: int, preset: Preset, offset: int, device) -> torch.Tensor:
    """The bases chained MTP steps from 2 on train at: every ``preset.mtp_stride``-th of ``n``
    from ``offset`` (mod the stride)."""
    return torch.arange(n, device=device)[offset % preset.mtp_stride :: preset.mtp_stride]


def losses(
    model: TrainModel, tokens: torch.Tensor, preset: Preset, offset: int = 0, bases: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """LM cross-entropy and each MTP step's distillation loss for a batch [B, L].

    Chained steps from 2 on train at every ``preset.mtp_stride``-th base from ``offset``
    (step 1 at all): they cost a full layer and LM head each, and matter less. ``bases``
    gives them instead (a captured step reads them from a tensor it does not own).
    """
    hidden = model.hidden(tokens)
    logits = model.logits(hidden)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    depth = preset.mtp_depth
    n = tokens.shape[1] - 1 - depth
    every = torch.arange(n, device=tokens.device)
    bases = mtp_bases(n, preset, offset, tokens.device) if bases is None else bases
    outs = model.mtp_chain(tokens[:, :-1], hidden[:, :-1].detach(), depth, bases=bases)
    mtp = []
    for step, out in enumerate(outs, start=1):
        at = every if step == 1 else bases
        target = logits[:, at + step].detach().softmax(-1)  # main's view of token t + step + 1
        mtp.append(F.cross_entropy(model.logits(out).flatten(0, 1), target.flatten(0, 1)))
    return lm, mtp


def accumulate_gradients(
    model: TrainModel, tokens: torch.Tensor, preset: Preset, step: int, autocast, bases: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backward of the batch's loss, in ``preset.micro_batch`` rows at a time (each part's loss
    weighted by its share, so the gradients are the whole batch's); returns [lm, mtp 1..depth]."""
    parts = tokens.split(preset.micro_batch or len(tokens))
    total = None
    for part in parts:
        with autocast:
            lm, mtp = losses(model, part, preset, offset=step, bases=bases)
            loss = lm + preset.mtp_weight * sum(mtp)
        share = len(part) / len(tokens)
        (loss if len(parts) == 1 else loss * share).backward()
        figures = torch.stack([lm.detach(), *(m.detach() for m in mtp)]).float() * share
        total = figures if total is None else total + figures
    return total


def batch_starts(stream_len: int, preset: Preset, seed: int) -> torch.Tensor:
    """Every step's window starts [steps, batch], drawn up front from their own generator."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, stream_len - preset.seq_len, (preset.steps, preset.batch_size), generator=generator)


#: steps timed before a time budget fixes the run's length (the first ones compile and warm up)
CALIBRATE_FROM, CALIBRATE_TO = 5, 25


def steps_within(left_s: float, timed_s: float, preset: Preset) -> int:
    """The run's length in steps when ``left_s`` seconds remain at step CALIBRATE_FROM and
    the calibration steps took ``timed_s``: never past the preset, never before the calibration."""
    per_step = timed_s / (CALIBRATE_TO - CALIBRATE_FROM)
    return max(CALIBRATE_TO, min(preset.steps, CALIBRATE_FROM + int(left_s / per_step)))


def train(
    model: TrainModel, stream: torch.Tensor, preset: Preset, seed: int, device: torch.device,
    max_seconds: float | None = None,
) -> dict:
    """:func:`run_steps` with float32 products on the tensor cores (TF32) on CUDA, for the
    run only. The Gated DeltaNet recurrence is the model's float32 part (autocast gives the
    rest bf16): small batched matmuls per 32-token block, which in full float32 run on the
    CUDA cores (their share of a step is not measured yet; fla's chunked kernels take TF32
    in the same algebra). ``NINFER_TRAIN_TF32=0`` keeps full float32."""
    tf32 = device.type == "cuda" and os.environ.get("NINFER_TRAIN_TF32", "1") != "0"
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = previous or tf32
    try:
        return {**run_steps(model, stream, preset, seed, device, max_seconds), "tf32": tf32}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def run_steps(
    model: TrainModel, stream: torch.Tensor, preset: Preset, seed: int, device: torch.device,
    max_seconds: float | None = None,
) -> dict:
    """Run ``preset.steps`` steps on token ``stream`` [N]; returns loss figures and the time taken.

    With ``max_seconds``, the run times its steps CALIBRATE_FROM..CALIBRATE_TO and then
    shortens itself to what fits, schedule included (the cosine decays over the shorter
    run): a benchmark on a rationed device gets a finished checkpoint instead of being
    killed mid-run. The result then depends on the machine's speed, and the report says
    how many steps ran.

    The stream and the batch plan live on ``device``, and the running losses stay there
    too, read back only when logged: no host round trip in the loop."""
    graphed = capturable(preset, device)
    optimizer = make_optimizer(model, preset, graphed)
    # a captured step must not keep autocast's cached weight casts from its capture
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=not graphed)

    def body(tokens: torch.Tensor, step: int, bases: torch.Tensor | None = None) -> torch.Tensor:
        figures = accumulate_gradients(model, tokens, preset, step, autocast, bases)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return figures

    positions = preset.seq_len - 1 - preset.mtp_depth  # the bases chained MTP steps pick from
    stepper = GraphedStep(body, optimizer, lambda step: mtp_bases(positions, preset, step, device),
                          (preset.batch_size, preset.seq_len), device) if graphed else None
    stream = stream.to(device)
    starts = batch_starts(len(stream), preset, seed).to(device)
    window = torch.arange(preset.seq_len, device=device)
    model.train()
    start, log_every = time.perf_counter(), max(1, preset.steps // 10)
    running = None  # [lm, mtp 1..depth], exponential moving averages
    steps, step, timed_from = preset.steps, 0, 0.0
    while step < steps:
        if max_seconds is not None and step in (CALIBRATE_FROM, CALIBRATE_TO) and preset.steps > CALIBRATE_TO:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step == CALIBRATE_FROM:
                timed_from = time.perf_counter()
            else:
                steps = steps_within(max_seconds - (timed_from - start), time.perf_counter() - timed_from, preset)
                if steps < preset.steps:
                    logger.info("time budget {:.0f} s: {} of the preset's {} steps", max_seconds, steps, preset.steps)
        tokens = stream[starts[step, :, None] + window]
        if stepper is not None:
            now = stepper.run(tokens, step, lr_at(step, preset, steps))
        else:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, preset, steps)
            optimizer.zero_grad(set_to_none=True)
            now = body(tokens, step)
        running = now if running is None else running.lerp(now, 0.1)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            lm_avg, *mtp_avg = running.tolist()
            logger.info("step {}/{}: lm loss {:.3f}, mtp loss {} ({:.0f} s)", step + 1, steps, lm_avg,
                        " ".join(f"{m:.3f}" for m in mtp_avg), time.perf_counter() - start)
        step += 1
    lm_avg, *mtp_avg = running.tolist()  # waits for the device to finish
    model.eval()
    # whether the steps ran from a graph (a capture that failed left the loop eager)
    graphed = stepper is not None and stepper.graph is not None
    return {"train_seconds": time.perf_counter() - start, "steps": steps, "graphed": graphed,
            "final_lm_loss": lm_avg, "final_mtp_loss": mtp_avg}
