"""Loading a hybrid Qwen checkpoint into :class:`ninfer_plugins.models.hybrid_decoder.HybridLM`.

Names are Hugging Face's. Qwen3.5 checkpoints put the text decoder under
``model.language_model.`` (read as ``model.``) beside a vision tower under ``model.visual.``,
which the text path skips. Separate projections land in slices of our fused ones
(``fused_shards``), per-expert tensors in slices of the stacked experts, zero-centred
norm weights are stored as ``1 + w``, and Qwen3-Next's head-grouped fused projections
are reordered (``GatedDeltaNet.ungroup``).
"""

from __future__ import annotations

import re
from collections import Counter
from functools import partial
from typing import Callable, Iterable, Optional

import torch
from loguru import logger
from torch import nn

from ninfer.model.weight_format import WeightFormatError
from ninfer_kernels import quant_rows
from ninfer_plugins.models.gated_deltanet import GatedDeltaNet
from ninfer_plugins.models.hybrid_norms import ZeroCentredRMSNorm
from ninfer_plugins.models.moe import Experts
from ninfer_plugins.models.weight_sink import WeightSink

TEXT_PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.", "visual.")
_PROJ_NAME = re.compile(r"^(?P<module>.+)\.(?P<proj>\w+)\.(?P<kind>weight|bias)$")
_EXPERT_NAME = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_IGNORED_NAME = re.compile(r"\.rotary_emb\.inv_freq$")

Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]


class WeightRouter:
    """Finds where each checkpoint tensor goes: ``(parameter name, index, transform)``."""

    def __init__(self, model: nn.Module, grouped_projections: bool, tied_lm_head: bool, has_mtp: bool):
        self.sink = WeightSink(model)
        self.params = self.sink.params
        self.modules = self.sink.modules
        self.grouped_projections = grouped_projections
        self.tied_lm_head = tied_lm_head
        self.has_mtp = has_mtp
        self.skipped: Counter[str] = Counter()

    def route(self, name: str) -> tuple[str, tuple, Transform] | None:
        if name.startswith(TEXT_PREFIX):
            name = "model." + name[len(TEXT_PREFIX) :]
        if name.startswith(VISION_PREFIXES):
            self.skipped["vision-tower tensor(s) (model.visual.*): this build serves the text decoder only"] += 1
            return None
        if name.startswith("mtp.") and not self.has_mtp:
            self.skipped["MTP tensor(s) (mtp.*): the config declares no mtp_num_hidden_layers"] += 1
            return None
        if _IGNORED_NAME.search(name) or (name == "lm_head.weight" and self.tied_lm_head):
            return None
        if name in self.params:
            return name, (), self._transform(name)
        if (m := _EXPERT_NAME.match(name)) and isinstance(self.modules.get(m["module"]), Experts):
            param, index = self.modules[m["module"]].expert_slice(int(m["expert"]), m["proj"])
            return f"{m['module']}.{param}", index, None
        if (m := _PROJ_NAME.match(name)) and hasattr(self.modules.get(m["module"]), "fused_shards"):
            owner = self.modules[m["module"]]
            shards = owner.fused_shards()
            if m["proj"] in shards:
                fused, rows = shards[m["proj"]]
                transform = None
                if self.grouped_projections and isinstance(owner, GatedDeltaNet) and m["kind"] == "weight":
                    transform = partial(owner.ungroup, m["proj"])  # Qwen3-Next's per-key-head order
                return f"{m['module']}.{fused}.{m['kind']}", (rows,), transform
        raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")

    def _transform(self, param: str) -> Transform:
        owner = self.modules.get(param.rpartition(".")[0])
        if isinstance(owner, ZeroCentredRMSNorm):
            return owner.from_checkpoint
        return None


def _transformed(transform: Callable[[torch.Tensor], torch.Tensor], value, name: str):
    """``transform`` applied to a checkpoint tensor; a quantized weight's rows are reordered the
    way ``transform`` reorders a column of row indices (Qwen3-Next's grouped projections)."""
    if not quant_rows.is_quantized(value):
        return transform(value)
    rows = value.shape[-2]
    order = transform(torch.arange(rows).unsqueeze(1)).squeeze(1)
    if order.shape != (rows,):
        raise WeightFormatError("this checkpoint tensor is transformed at load in a way a quantized layout cannot "
                                "follow", name)
    moved = quant_rows.take_rows(value, order)
    if moved is None:
        raise WeightFormatError(f"its rows regroup in runs that are not whole {value.block[0]}-row scale blocks, "
                                "so the FP8 layout cannot be reordered", name)
    return moved


def load_hybrid_weights(
    weights: Iterable[tuple[str, torch.Tensor]], router: WeightRouter, optional: str = "mtp."
) -> bool:
    """Copy every checkpoint tensor into place; fail on unknown names and on gaps.

    Parameters under the ``optional`` prefix may be absent altogether (checkpoints that
    transformers re-saved lose the MTP layer while their config still declares it), but
    not in part. Returns whether they were loaded. Values may be quantized weights (see
    :mod:`ninfer_plugins.models.weight_sink`).
    """
    with torch.no_grad():
        for name, value in weights:
            target = router.route(name)
            if target is None:
                continue
            param_name, index, transform = target
            if transform is not None:
                value = _transformed(transform, value, name)
            router.sink.put(name, param_name, index, value)
        for reason, count in router.skipped.items():
            logger.info("skipped {} {}", count, reason)
        return router.sink.finish(optional)
