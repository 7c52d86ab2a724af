"""Reference gated delta rule: the linear attention of Gated DeltaNet layers.

Each value head keeps a state matrix ``S`` [Dk, Dv]. For a token with (L2-normalised)
key ``k``, query ``q`` (also scaled by ``Dk ** -0.5``), value ``v``, log-decay ``g <= 0``
and write strength ``beta`` in (0, 1)::

    S <- exp(g) * S                     # forget a little
    S <- S + k (beta * (v - S^T k))^T   # delta rule: write what S mispredicts for k
    o  = S^T q

Query/key heads may be fewer than value heads; value head ``h`` reads query/key head
``h // (Hv // Hk)``. Sequences come varlen (as in :class:`ForwardBatch`) and keep their
state in ``states[slot]`` between steps: a sequence whose chunk starts at position 0
begins from zeros, any other continues from its slot. Decode rows (one token) of a
step are updated together; longer chunks use the chunked form below, whose result
equals the token loop up to float rounding. All maths is float32.
"""

from __future__ import annotations

import itertools

import torch

from ninfer.model.forward_batch import ForwardBatch

#: tokens per block of the chunked form (the triangular solve is CHUNK x CHUNK)
CHUNK = 64
#: added to the squared norm before the inverse square root, as Qwen's kernels do
L2_EPS = 1e-6


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q/k [..., Hk, Dk] normalised, q scaled, heads repeated up to ``num_v_heads``."""
    group = num_v_heads // q.shape[-2]
    q = l2_normalise(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalise(k.float())
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per state: q/k [..., H, Dk], v [..., H, Dv], g/beta [..., H], state [..., H, Dk, Dv]."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("...hk,...hkv->...hv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...hk,...hkv->...hv", q, state), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, many tokens: q/k [L, H, Dk], v [L, H, Dv], g/beta [L, H], state [H, Dk, Dv].

    Within a block, with ``c_i`` the cumulative log-decay up to token ``i`` and ``u_j`` the
    vector token ``j`` writes, every ``u_j`` depends linearly on the earlier ones through
    ``beta_j exp(c_j - c_l) (k_j . k_l)``: a unit lower-triangular system solved once per
    block. Outputs and the block's final state then follow from matmuls, and only the
    state crosses block boundaries.
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for s in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[s : s + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        gc, bc = (x[s : s + chunk].transpose(0, 1) for x in (g, beta))  # [H, C]
        size = qc.shape[1]
        cum = gc.cumsum(dim=-1)
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        # exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        mixing = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = torch.cat([bc[..., None] * vc, (bc * cum.exp())[..., None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(mixing, rhs, upper=False, unitriangular=True)
        dv = vc.shape[-1]
        writes = solved[..., :dv] - solved[..., dv:] @ state  # u_j, [H, C, Dv]
        scores = (qc @ kc.transpose(-1, -2)) * decay
        out[s : s + size] = ((qc * cum.exp()[..., None]) @ state + scores @ writes).transpose(0, 1)
        to_end = (cum[:, -1:] - cum).exp()  # decay from each token to the block's end
        state = state * cum[:, -1].exp()[:, None, None] + (kc * to_end[..., None]).transpose(-1, -2) @ writes
    return out, state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """Varlen gated delta rule; returns [T, Hv, Dv] in ``v``'s dtype and updates ``states``.

    ``q``/``k`` [T, Hk, Dk] un-normalised (normalised here), ``v`` [T, Hv, Dv], ``g``/``beta``
    [T, Hv], ``states`` [num_slots, Hv, Dk, Dv] float32, one slot per sequence in
    ``batch.state_slots``. Rows past the last sequence come back as zeros.
    """
    num_v_heads, out_dtype = v.shape[-2], v.dtype
    q, k = prepare_qk(q, k, num_v_heads)
    v, g, beta = v.float(), g.float(), beta.float()
    if batch.state_slots is None:
        raise ValueError("this model keeps recurrent state: the batch needs state_slots")
    slots = batch.state_slots.tolist()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    starts = list(itertools.accumulate(batch.query_lens_host, initial=0))
    decode = [i for i, n in enumerate(batch.query_lens_host) if n == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=v.device)
        index = torch.tensor([slots[i] for i in decode], device=v.device)
        fresh = torch.tensor([batch.seq_lens_host[i] == 1 for i in decode], device=v.device)
        initial = states.index_select(0, index).masked_fill(fresh[:, None, None, None], 0.0)
        out[rows], final = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
        states.index_copy_(0, index, final.to(states.dtype))
    for i, length in enumerate(batch.query_lens_host):
        if length <= 1:
            continue
        rows = slice(starts[i], starts[i] + length)
        if batch.seq_lens_host[i] == length:
            initial = torch.zeros(states.shape[1:], dtype=torch.float32, device=v.device)
        else:
            initial = states[slots[i]].float()
        out[rows], final = chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
        states[slots[i]] = final.to(states.dtype)
    return out.to(out_dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's per-token gates from the input projection's ``a`` and ``b`` columns
    ([T, Hv], strided views are fine): the log-decay ``g = -exp(A_log) * softplus(a +
    dt_bias)`` in float32 and the write strength ``beta = sigmoid(b)`` in ``b``'s dtype."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g, beta
