"""The gated delta rule for training: the chunked form of :mod:`ninfer_kernels.gated_delta`,
rearranged for autograd on a CPU.

The inference reference walks the blocks one by one and solves each block's triangular
system with ``solve_triangular``, which on a CPU costs far more than the rest of a
training step (small batched LAPACK calls, forward and backward). Here every block's
system is solved at once, as a product of matrix squares (the system matrix is ``I + A``
with ``A`` strictly lower triangular, so ``A ** C == 0`` and
``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...``), and only the state update walks the
blocks (FLA's WY form). The inverse's gradient is its closed form (two products per
block) rather than autograd's walk back through the squares, and the blocks are
unbound, not indexed, so the backward never writes a full-size tensor per block. The
result equals the reference up to float rounding (tests/test_train.py compares them).

With a ``state`` to start from and ``return_state``, the same function continues a
sequence: the report's greedy decoding feeds it a prompt, then one token at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 32


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + a)^-1`` for strictly lower-triangular ``a`` [..., C, C] (C a power of two)."""
    size = a.shape[-1]
    n = -a
    inv = torch.eye(size, dtype=a.dtype, device=a.device) + n
    power, reach = n, 2
    while reach < size:
        power = power @ power
        inv = inv + inv @ power
        reach *= 2
    return inv


class _UnitLowerInverse(torch.autograd.Function):
    """:func:`unit_lower_inverse` with the inverse's own gradient, ``-M^-T G M^-T`` for
    ``M = I + a``, instead of autograd's walk back through every matrix square."""

    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        inv = unit_lower_inverse(a)
        ctx.save_for_backward(inv)
        return inv

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (inv,) = ctx.saved_tensors
        inv_t = inv.transpose(-1, -2)
        return -(inv_t @ grad @ inv_t).tril(-1)  # ``a`` is strictly lower: nothing flows elsewhere


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK,
    state: torch.Tensor | None = None, return_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q/k [N, L, Dk] (normalised, q scaled), v [N, L, Dv], g/beta [N, L], all float32, from
    ``state`` [N, Dk, Dv] (zeros without it). Returns the outputs [N, L, Dv], and with
    ``return_state`` the state after the last token too."""
    length = q.shape[1]
    pad = -length % chunk
    if pad:  # padded tokens come last and write nothing (beta = 0), so earlier outputs are unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    q, k, v = (t.reshape(n, -1, chunk, t.shape[-1]) for t in (q, k, v))  # [N, blocks, C, D]
    g, beta = g.reshape(n, -1, chunk), beta.reshape(n, -1, chunk)
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    inv = _UnitLowerInverse.apply((beta[..., None] * kk * decay).tril(-1))
    u = inv @ (beta[..., None] * v)  # what each token writes, before the state's prediction
    w = inv @ ((beta * cum.exp())[..., None] * k)  # how the state's prediction enters it
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    block_decay = cum[..., -1].exp()[..., None, None]

    def per_block(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # unbind, not indexing: indexing's backward writes a full-size zero tensor per block
        return t.transpose(0, 1).contiguous().unbind(0)

    outs = []
    for u_b, w_b, qd_b, s_b, ke_b, bd_b in zip(*map(per_block, (u, w, q_decayed, scores, k_to_end, block_decay))):
        if state is None:  # the state starts at zero
            writes = u_b
            outs.append(s_b @ writes)
            state = ke_b @ writes
        else:
            writes = u_b - w_b @ state
            outs.append(qd_b @ state + s_b @ writes)
            state = state * bd_b + ke_b @ writes
    out = torch.stack(outs, dim=1).reshape(n, -1, dv)[:, :length]
    return (out, state) if return_state else out
