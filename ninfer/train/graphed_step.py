"""A whole optimisation step in one CUDA graph: forward, backward, clipping, AdamW.

The presets' models are small, so an eager step is thousands of tiny kernels, each
launched by Python through autograd; the host cannot keep the GPU busy. Session 32
measured it: the ``gpu-deep`` preset (32 layers, its batch in four parts to fit an 80 GB
card) took 2.5 s a step on an H100 and ran 124 of its 800 steps in five minutes. Captured
once, a step is one graph replay, and the device sets the pace.

What the graph needs, and how the loop provides it:

- fixed input tensors: the batch and the MTP bases are copied into tensors the graph
  owns (:attr:`tokens`, :attr:`bases`); the bases' count is the same at every offset only
  when the stride divides the positions (:func:`capturable`), otherwise the loop stays
  eager;
- the learning rate as a device tensor (fused AdamW reads it there), filled before each
  replay; AdamW keeps its step counts on the device too;
- warm-up before capture: the first :data:`EAGER_STEPS` steps run eagerly on a side
  stream (they are real steps of the run, with their own batches), so cuBLAS workspaces
  and lazily built state exist before capture;
- no cached autocast casts: each replay casts the weights it reads afresh, as an eager
  step with a fresh autocast context does.

Gradients are assigned, not accumulated, by the first backward inside the graph (they
were None when it was captured), so every replay starts from zero as ``zero_grad`` does.
``NINFER_TRAIN_GRAPH=0`` keeps the loop eager (for comparisons); a step that fails to
capture logs why and the loop goes on eagerly.
"""

from __future__ import annotations

import os

import torch
from loguru import logger

from ninfer.train.presets import Preset

#: eager steps before the capture (the captured one is the next)
EAGER_STEPS = 3


def capturable(preset: Preset, device: torch.device) -> bool:
    """Whether the loop can run ``preset`` from a graph on ``device``."""
    positions = preset.seq_len - 1 - preset.mtp_depth
    return (device.type == "cuda" and os.environ.get("NINFER_TRAIN_GRAPH", "1") != "0"
            and positions % preset.mtp_stride == 0 and preset.steps > EAGER_STEPS)


class GraphedStep:
    """Runs steps through ``body(tokens, step, bases) -> figures`` (the backward of one batch,
    clipping and the optimiser step): eagerly at first, then as one captured graph.
    ``bases_at(step)``: the step's MTP bases (the same count at every step)."""

    def __init__(self, body, optimizer: torch.optim.Optimizer, bases_at, batch_shape, device: torch.device):
        self.body, self.optimizer, self.bases_at = body, optimizer, bases_at
        self.tokens = torch.zeros(batch_shape, dtype=torch.int64, device=device)
        self.bases = bases_at(0).clone()
        self.side = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.figures: torch.Tensor | None = None
        self.eager_only = False  # set when the capture failed

    def run(self, tokens: torch.Tensor, step: int, lr: float) -> torch.Tensor:
        """Step ``step`` on batch ``tokens`` at learning rate ``lr``; returns its loss figures."""
        if self.graph is None and (step < EAGER_STEPS or self.eager_only):
            return self._eager(tokens, step, lr)
        self._stage(tokens, step, lr)
        if self.graph is None:
            try:
                self._capture(step)
            except RuntimeError as exc:  # an op that cannot be captured: train on, eagerly
                logger.warning("the training step could not be captured in a CUDA graph ({}); going on eagerly",
                               str(exc).splitlines()[0][:200])
                self.eager_only = True
                return self._eager(tokens, step, lr)
        self.graph.replay()
        return self.figures.clone()

    def _stage(self, tokens: torch.Tensor, step: int, lr: float) -> None:
        self._set_lr(lr)
        self.tokens.copy_(tokens)
        self.bases.copy_(self.bases_at(step))

    def _eager(self, tokens: torch.Tensor, step: int, lr: float) -> torch.Tensor:
        """The step without the graph, on the side stream (as warm-up before a capture must run)."""
        self.side.wait_stream(torch.cuda.current_stream())
        tokens.record_stream(self.side)  # the default stream made it; the side stream reads it
        with torch.cuda.stream(self.side):
            self._stage(tokens, step, lr)
            self.optimizer.zero_grad(set_to_none=True)
            figures = self.body(self.tokens, step, self.bases)
        torch.cuda.current_stream().wait_stream(self.side)
        return figures

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"].fill_(lr)

    def _capture(self, step: int) -> None:
        torch.cuda.synchronize()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # the eager steps' activations: the graph's pool takes their place
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.figures = self.body(self.tokens, step, self.bases)
        self.graph = graph
