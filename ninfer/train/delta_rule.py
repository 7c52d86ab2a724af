"""The gated delta rule for training: the chunked form of :mod:`ninfer_kernels.gated_delta`,
rearranged for autograd on a CPU.

The inference reference walks the blocks one by one and solves each block's triangular
system with ``solve_triangular``, which on a CPU costs far more than the rest of a
training step (small batched LAPACK calls, forward and backward). Here every block's
system is solved at once, as a product of matrix squares (the system matrix is ``I + A``
with ``A`` strictly lower triangular, so ``A ** C == 0`` and
``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...``), and only the state update walks the
blocks (FLA's WY form). The result equals the reference up to float rounding
(tests/test_train.py compares them).
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


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> torch.Tensor:
    """Zero initial state; q/k [N, L, Dk] (normalised, q scaled), v [N, L, Dv], g/beta [N, L],
    all float32. Returns the outputs [N, L, Dv]."""
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
    inv = unit_lower_inverse((beta[..., None] * kk * decay).tril(-1))
    u = inv @ (beta[..., None] * v)  # what each token writes, before the state's prediction
    w = inv @ ((beta * cum.exp())[..., None] * k)  # how the state's prediction enters it
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()
    state = q.new_zeros(n, dk, dv)
    outs = []
    for b in range(q.shape[1]):
        writes = u[:, b] - w[:, b] @ state
        outs.append(q_decayed[:, b] @ state + scores[:, b] @ writes)
        state = state * block_decay[:, b, None, None] + k_to_end[:, b].transpose(-1, -2) @ writes
    return torch.stack(outs, dim=1).reshape(n, -1, dv)[:, :length]
