"""transformers' model built on the meta device, then made real one block at a time.

A random 35B-A3B in bf16 is 67 GB. Built whole on the device beside the copy our loader
makes, it needs two of that: more than an 80 GB H100 holds, and building it in host memory
instead takes minutes of CPU initialisation. Built here, a block (a decoder layer, the
embedding, the head) is allocated on the device, initialised by transformers' own
``_init_weights`` (the same distributions its ``from_config`` uses), handed over, and
freed before the next one exists, so only one block is ever held beside our copy.

Both engines of a benchmark must run the same weights, so the transformers baseline is
made the same way, keeping every block (:func:`whole`): a seed gives the same tensors in
both. (They are not the tensors ``from_config`` would draw: its random draws run in
another order.)
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch

#: a subtree up to this size is one block (a decoder layer of the shapes we build)
BLOCK_BYTES = 4 << 30


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))


def blocks(module: torch.nn.Module, prefix: str = "", above: tuple = ()) -> Iterator[tuple]:
    """``module``'s blocks in state-dict order, as (name prefix, block, the modules above
    it): the largest subtrees within :data:`BLOCK_BYTES`, and any module holding tensors of
    its own whole."""
    own = next(itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)), None)
    children = list(module.named_children())
    if own is not None or not children or _bytes(module) <= BLOCK_BYTES:
        yield prefix, module, above
        return
    for name, child in children:
        yield from blocks(child, f"{prefix}{name}.", (module,) + above)


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


@torch.no_grad()
def _make_real(model, block: torch.nn.Module, name: str, above: tuple, device: torch.device) -> None:
    """Allocate ``block`` on ``device`` and initialise it as transformers does: children
    first, as its ``initialize_weights`` walks, then the modules above, whose initialiser
    may reach into it (a MoE block draws its router's weight; on the tensors of blocks not
    real at the time it does nothing). Every tensor starts as NaN, so one that no
    initialiser reaches fails here instead of running on leftover memory."""
    block.to_empty(device=device)
    for tensor in itertools.chain(block.parameters(), block.buffers()):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
    for module in itertools.chain(_post_order(block), above):
        model._init_weights(module)
    for tensor_name, tensor in itertools.chain(block.named_parameters(), block.named_buffers()):
        if tensor.is_floating_point() and torch.isnan(tensor).any():
            raise RuntimeError(f"random weights: transformers' initialisation left {name}{tensor_name} unset")


def _named_tensors(module: torch.nn.Module):
    return itertools.chain(module.named_parameters(), module.named_buffers())


def _owned(model) -> set[str]:
    """Every tensor's name, a tied one under its first name only (counted on the meta
    device: making a block real gives its modules new tensors, which unties them)."""
    return set(dict(_named_tensors(model)))


def _real_blocks(model, device: torch.device, seed: int) -> Iterator[tuple[str, torch.nn.Module]]:
    """Each block holding a tensor of its own, made real, then put back on the meta device
    once the caller asks for the next: only one is ever real, so an initialiser of the
    modules above draws for that block's tensors alone, the same in both builds below. A
    head tied to the embedding holds none of its own and is skipped (made by tying)."""
    owned = _owned(model)
    torch.manual_seed(seed)
    for prefix, block, above in list(blocks(model)):
        if any(prefix + name in owned for name, _ in _named_tensors(block)):
            _make_real(model, block, prefix, above, device)
            yield prefix, block
            block.to_empty(device=torch.device("meta"))


def whole(model, device: torch.device, seed: int):
    """``model`` (built on the meta device) made real on ``device``, every block kept."""
    made = [(prefix + name, tensor.detach()) for prefix, block in _real_blocks(model, device, seed)
            for name, tensor in _named_tensors(block)]
    for name, tensor in made:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
    model.tie_weights()
    return model


def stream(model, device: torch.device, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s checkpoint tensors (a tied one once), made real block by block on
    ``device``; each block is freed once the consumer asks for the next one's tensors."""
    wanted = _owned(model) & set(model.state_dict(keep_vars=True))
    for prefix, block in _real_blocks(model, device, seed):
        for name, tensor in _named_tensors(block):
            if prefix + name in wanted:
                yield prefix + name, tensor.detach()
        tensor = None  # noqa: F841  (else the block's last tensor lives on while the next is made)
