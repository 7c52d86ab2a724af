"""Which tensors of a tiny dense checkpoint a quantized tiny checkpoint quantizes.

As the released quantized Qwen checkpoints do: every linear projection of the decoder and
the MTP layer, but not the embeddings, the LM head, MoE routers (``mlp.gate``), the shared
expert's gate, Gated DeltaNet's narrow ``in_proj_b`` / ``in_proj_a`` (Qwen's FP8 releases keep
them dense) nor the vision tower. Stacked experts (Qwen3.5-MoE's ``experts.gate_up_proj``)
are written one tensor per expert, the layout every quantizer exports.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import torch

#: the projections a tiny checkpoint quantizes, by their last name component
QUANTIZED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
             "in_proj_z", "in_proj_qkvz", "out_proj", "fc"}
#: what stays dense, as module-name patterns each format's config can carry
KEPT_DENSE = ("lm_head", "mlp.gate", "shared_expert_gate", "in_proj_b", "in_proj_a", "in_proj_ba", "visual")
#: checkpoint projections whose quantizers share one global scale (fused at inference)
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: projections our models fuse with a neighbour: FP8 blocks must not straddle their boundaries
FUSED_ROWS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z"}
#: the block and group size released checkpoints use, and the smaller ones tiny shapes need
SIZES = (128, 64, 32, 16)

_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors split into Hugging Face's per-expert names."""
    out = {}
    for name, tensor in tensors.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            base = f"{m['prefix']}.{e}."
            if m["proj"] == "down_proj":
                out[base + "down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate, up
    return out


def quantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The module names (``....q_proj``) whose ``.weight`` a quantized tiny checkpoint quantizes."""
    modules = []
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or tensor.dim() != 2 or ".visual." in f".{module}.":
            continue
        if module.rpartition(".")[2] in QUANTIZED:
            modules.append(module)
    return modules


def fitting_size(sizes: Iterable[int]) -> int:
    """The largest of :data:`SIZES` dividing every one of ``sizes``: 128, as released, when
    the model's shapes allow it."""
    sizes = list(sizes)
    return next((s for s in SIZES if all(n % s == 0 for n in sizes)), SIZES[-1])


def int4_group_size(tensors: dict[str, torch.Tensor], modules: list[str]) -> int:
    """A group size dividing every quantized layer's inputs."""
    return fitting_size(tensors[f"{m}.weight"].shape[1] for m in modules)


def fp8_block_size(tensors: dict[str, torch.Tensor], modules: list[str], config: dict | None = None) -> int:
    """A square block keeping every fused projection's shards block-aligned (and, for
    Qwen3-Next's head-grouped ``in_proj_qkvz``, each head's q/k and v/z runs, which the
    loader regroups)."""
    sizes = [tensors[f"{m}.weight"].shape[0] for m in modules if m.rpartition(".")[2] in FUSED_ROWS]
    if config and any(m.endswith(".in_proj_qkvz") for m in modules):
        ratio = config["linear_num_value_heads"] // config["linear_num_key_heads"]
        sizes += [config["linear_key_head_dim"], ratio * config["linear_value_head_dim"]]
    return fitting_size(sizes)


def sibling_groups(modules: list[str]) -> list[list[str]]:
    """``modules`` grouped so that fused siblings (q/k/v, gate/up of one MLP) share a group."""
    groups: dict[tuple[str, int], list[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        kind = next((i for i, group in enumerate(FUSED_SIBLINGS) if leaf in group), None)
        key = (parent, kind) if kind is not None else (module, -1)
        groups.setdefault(key, []).append(module)
    return list(groups.values())


def dense_module_names(tensors: dict[str, torch.Tensor], quantized: list[str]) -> list[str]:
    """Linear layers left dense, by their full names (Qwen's ``modules_to_not_convert`` style)."""
    chosen = set(quantized)
    names = []
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and tensor.dim() == 2 and module not in chosen and "embed_tokens" not in module:
            names.append(module)
    return sorted(names)


def int4_layers(tensors: dict[str, torch.Tensor], symmetric: bool,
                spell: Callable[[str, torch.Tensor, object], dict[str, torch.Tensor]]) -> tuple[dict, list[str], int]:
    """A tiny checkpoint with every quantized layer as int4 groups (the group 128 as released
    where the shapes allow): ``spell(module, dense weight, Int4Group)`` gives the tensors a
    format stores for one layer. Returns (every tensor, the quantized modules, the group)."""
    from ninfer_plugins.weights.quantize import int4_group

    tensors = per_expert(tensors)
    modules = quantized_modules(tensors)
    out = dict(tensors)
    group = int4_group_size(tensors, modules)
    for module in modules:
        w = out.pop(f"{module}.weight")
        out.update(spell(module, w, int4_group(w, group, symmetric=symmetric)))
    return out, modules, group


def nvfp4_layers(tensors: dict[str, torch.Tensor],
                 spell: Callable[[str, object], dict[str, torch.Tensor]]) -> tuple[dict, list[str]]:
    """A tiny checkpoint with every quantized layer in NVFP4, fused siblings sharing one global
    factor as the exporters tie them: ``spell(module, Nvfp4)`` gives the tensors a format
    stores for one layer. Returns (every tensor, the quantized modules)."""
    from ninfer_plugins.weights.quantize import nvfp4, nvfp4_alpha

    tensors = per_expert(tensors)
    modules = quantized_modules(tensors)
    out = dict(tensors)
    for group in sibling_groups(modules):
        alpha = nvfp4_alpha(*(tensors[f"{m}.weight"] for m in group))
        for module in group:
            out.update(spell(module, nvfp4(out.pop(f"{module}.weight"), alpha)))
    return out, modules
