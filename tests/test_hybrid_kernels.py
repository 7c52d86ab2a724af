"""Gated DeltaNet kernels: the torch references against transformers and against themselves,
and the Triton kernels against the references (in Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.model.forward_batch import ForwardBatch
from ninfer_kernels import causal_conv, gated_delta, ops

TOL = 1e-4
#: CPU-tensor checks: Triton kernels run in its interpreter, and transformers' reference
#: functions stay on torch. On a CUDA machine (no interpreter, fla picked up by
#: transformers) the gpu tests below cover the kernels at real shapes instead.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/interpreter check; gpu tests cover CUDA")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def state_batch(specs: list[tuple[int, int]], slots: list[int], pad_rows: int = 0, device: str = "cpu") -> ForwardBatch:
    """(tokens already in the state, new tokens) per sequence; only the state fields matter here."""
    q_lens = [n for _, n in specs]
    seq_lens = [c + n for c, n in specs]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = sum(q_lens) + pad_rows
    return ForwardBatch(
        query_start=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(specs), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
        block_size=16,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
    )


def delta_inputs(length: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, dtype=torch.float32):
    q = torch.randn(length, hk, dk, generator=gen).to(dtype)
    k = torch.randn(length, hk, dk, generator=gen).to(dtype)
    v = torch.randn(length, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(length, hv, generator=gen) * 0.3  # slow decay: the state matters for many tokens
    beta = torch.rand(length, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


def test_chunked_form_equals_the_token_loop():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = delta_inputs(150, 2, 4, 16, 8, gen)  # crosses two block boundaries
    q, k = gated_delta.prepare_qk(q, k, 4)
    state0 = torch.randn(4, 16, 8, generator=gen)
    got, got_state = gated_delta.chunked(q, k, v, g, beta, state0, chunk=64)
    state, rows = state0, []
    for t in range(150):
        o, state = gated_delta.recurrent_step(q[t], k[t], v[t], g[t], beta[t], state)
        rows.append(o)
    assert (got - torch.stack(rows)).abs().max() <= TOL
    assert (got_state - state).abs().max() <= TOL


@cpu_only
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers_reference(with_state):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = delta_inputs(90, 2, 4, 16, 16, gen)
    initial = torch.randn(1, 4, 16, 16, generator=gen) if with_state else None
    states = torch.zeros(3, 4, 16, 16)
    if with_state:
        states[2] = initial[0]
    batch = state_batch([(5 if with_state else 0, 90)], [2])
    ours = gated_delta.gated_delta_rule(q, k, v, g, beta, states, batch)
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        want, want_state = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=initial,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (ours - want[0]).abs().max() <= TOL
        assert (states[2] - want_state[0]).abs().max() <= TOL
    assert states[0].abs().max() == 0 and states[1].abs().max() == 0  # other slots untouched


def _run_in_steps(fn, steps, inputs, states):
    """Feed each sequence's tokens in the given (sequence -> chunk lengths) steps; returns outputs."""
    outs = {i: [] for i in range(len(inputs))}
    done = [0] * len(inputs)
    for step in steps:
        seqs = list(step)
        specs = [(done[i], step[i]) for i in seqs]
        batch = state_batch(specs, [i * 2 + 1 for i in seqs], pad_rows=1)
        parts = [[inputs[i][j][done[i] : done[i] + step[i]] for i in seqs] for j in range(len(inputs[0]))]
        flat = [torch.cat([*p, torch.zeros_like(p[0][:1])]) for p in parts]  # one padding row
        out = fn(*flat, states, batch)
        assert out[-1].abs().max() == 0, "padding rows stay zero"
        row = 0
        for i in seqs:
            outs[i].append(out[row : row + step[i]])
            row += step[i]
            done[i] += step[i]
    return [torch.cat(o) for o in outs.values()]


#: sequence -> tokens per step; mixes fresh prefills, continued chunks and decode rows in one batch
STEPS = [{0: 70, 1: 1}, {0: 1, 1: 9, 2: 3}, {0: 1, 1: 1, 2: 66}, {1: 1, 2: 1}, {0: 5, 2: 1}]


def _seq_inputs(gen, dtype=torch.float32):
    totals = [sum(s.get(i, 0) for s in STEPS) for i in range(3)]
    return [delta_inputs(n, 2, 4, 16, 16, gen, dtype) for n in totals]


@cpu_only
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_varlen_steps_with_slots_equal_one_pass(impl):
    """Chunked prefill, decode rows and fresh sequences in one batch equal one pass per sequence."""
    if impl == "triton":
        pytest.importorskip("triton")
        from ninfer_kernels.triton.gated_delta import recurrent_gated_delta_rule as fn
    else:
        fn = gated_delta.gated_delta_rule
    gen = torch.Generator().manual_seed(2)
    inputs = _seq_inputs(gen)
    states = torch.randn(7, 4, 16, 16, generator=gen)  # stale garbage: fresh sequences must ignore it
    got = _run_in_steps(fn, STEPS, inputs, states)
    for i, x in enumerate(inputs):
        fresh = torch.zeros(1, 4, 16, 16)
        want = gated_delta.gated_delta_rule(*x, fresh, state_batch([(0, len(x[0]))], [0]))
        assert (got[i] - want).abs().max() <= TOL, f"sequence {i}"
        assert (states[i * 2 + 1] - fresh[0]).abs().max() <= TOL


@cpu_only
def test_triton_recurrent_bf16_matches_reference():
    pytest.importorskip("triton")
    from ninfer_kernels.triton.gated_delta import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = delta_inputs(12, 2, 4, 16, 16, gen, torch.bfloat16)
    start = torch.randn(4, 4, 16, 16, generator=gen)
    batch = state_batch([(4, 1), (0, 6), (9, 5)], [3, 0, 1])
    want_states, got_states = start.clone(), start.clone()
    want = gated_delta.gated_delta_rule(q, k, v, g, beta, want_states, batch)
    got = recurrent_gated_delta_rule(q, k, v, g, beta, got_states, batch)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (got_states - want_states).abs().max() <= 1e-4
    assert torch.equal(got_states[2], start[2])


def test_fla_gets_the_same_sequence_bounds_for_every_layer_of_a_step():
    """fla memoizes its chunk indices by the identity of ``cu_seqlens`` (and derives them
    without a device sync from a host copy): every layer of a step must pass the same two
    tensors, the host copy equal to the device bounds; the next step gets its own."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton.gated_delta import step_layout

    batch = state_batch([(4, 1), (0, 6), (9, 5)], [3, 0, 1])
    layout = step_layout(batch)
    device, host = layout.cu_seqlens, layout.cu_seqlens_cpu
    again = step_layout(batch)
    assert again.cu_seqlens is device and again.cu_seqlens_cpu is host and again.fresh is layout.fresh
    assert device.dtype == host.dtype == torch.int64 and host.device.type == "cpu"
    assert host.tolist() == device.tolist() == batch.query_start.tolist() == [0, 1, 7, 12]
    following = state_batch([(5, 1), (6, 6)], [3, 0])
    assert step_layout(following).cu_seqlens_cpu.tolist() == [0, 1, 7]
    assert step_layout(following).cu_seqlens is not device


def test_fla_starts_from_the_slots_of_continuing_sequences_only():
    """The states handed to fla: none when every sequence starts fresh, the slots' (as
    float32) when all continue, zeros for the fresh ones of a mixed step; the pool itself
    untouched."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton.gated_delta import _initial_states, step_layout

    def initial(batch):
        return _initial_states(states, batch, step_layout(batch))

    states = torch.randn(5, 2, 4, 4).to(torch.bfloat16)
    before = states.clone()
    assert initial(state_batch([(0, 6), (0, 3)], [3, 0])) is None
    both = initial(state_batch([(4, 1), (9, 5)], [3, 0]))
    assert both.dtype == torch.float32 and torch.equal(both, states[[3, 0]].float())
    mixed = initial(state_batch([(4, 1), (0, 6), (9, 5)], [3, 0, 1]))
    assert torch.equal(mixed[0], states[3].float()) and torch.equal(mixed[2], states[1].float())
    assert not mixed[1].any()
    assert torch.equal(states, before)


def _conv_inputs(gen, dtype=torch.float32):
    totals = [sum(s.get(i, 0) for s in STEPS) for i in range(3)]
    return [(torch.randn(n, 24, generator=gen).to(dtype),) for n in totals]


@cpu_only
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_conv_in_steps_equals_full_convolution(impl):
    if impl == "triton":
        pytest.importorskip("triton")
        from ninfer_kernels.triton.causal_conv import causal_conv1d as conv
    else:
        conv = causal_conv.causal_conv1d
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(24, 4, generator=gen)
    inputs = _conv_inputs(gen)
    states = torch.randn(7, 3, 24, generator=gen)
    got = _run_in_steps(lambda x, s, b: conv(x, weight, s, b), STEPS, inputs, states)
    for i, (x,) in enumerate(inputs):
        # transformers' prefill path: zero-padded depthwise conv1d, then silu
        want = F.silu(F.conv1d(x.T[None], weight[:, None], padding=3, groups=24)[0, :, : len(x)].T)
        assert (got[i] - want).abs().max() <= TOL, f"sequence {i}"
        assert torch.equal(states[i * 2 + 1], x[-3:])


@cpu_only
def test_conv_triton_strided_input_and_bf16():
    """The conv reads a column slice of a wider projection without copying it first."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton.causal_conv import causal_conv1d

    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(9, 40, generator=gen).to(torch.bfloat16)
    x = wide[:, 8:32]
    weight = torch.randn(24, 1, 4, generator=gen).to(torch.bfloat16)  # conv1d's own weight layout
    start = torch.randn(3, 3, 24, generator=gen).to(torch.bfloat16)
    batch = state_batch([(2, 1), (0, 5), (7, 3)], [2, 0, 1])
    want_states, got_states = start.clone(), start.clone()
    want = causal_conv.causal_conv1d(x, weight[:, 0], want_states, batch)
    got = causal_conv1d(x, weight, got_states, batch)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # one bf16 ulp
    assert torch.equal(got_states, want_states)


def test_ops_dispatch_to_the_references_on_cpu():
    assert ops.choose("gated_delta_rule", "cpu") is gated_delta.gated_delta_rule
    assert ops.choose("causal_conv1d", "cpu") is causal_conv.causal_conv1d


def test_missing_state_slots_is_an_error():
    gen = torch.Generator().manual_seed(6)
    q, k, v, g, beta = delta_inputs(3, 1, 1, 4, 4, gen)
    batch = state_batch([(0, 3)], [0])
    batch.state_slots = None
    with pytest.raises(ValueError, match="state_slots"):
        gated_delta.gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 1, 4, 4), batch)


# -- CUDA: real Qwen3.6-27B shapes (16 q/k heads, 48 value heads, head dims 128) --------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("specs", [[(2047, 1)] * 8, [(0, 2048)], [(3000, 500), (100, 1), (0, 300)],
                                   [(1000, 700), (64, 300)]],
                         ids=["decode", "prefill", "mixed", "continued"])
def test_gated_delta_real_shapes(specs):
    gen = torch.Generator().manual_seed(7)
    total = sum(n for _, n in specs)
    q, k, v, g, beta = (x.cuda() for x in delta_inputs(total, 16, 48, 128, 128, gen, torch.bfloat16))
    start = torch.randn(len(specs), 48, 128, 128, generator=gen).cuda() * 0.1
    batch = state_batch(specs, list(range(len(specs))), device="cuda")
    want_states, got_states = start.clone(), start.clone()
    want = gated_delta.gated_delta_rule(q, k, v, g, beta, want_states, batch)
    got = ops.gated_delta_rule(q, k, v, g, beta, got_states, batch)
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2
    assert (got_states - want_states).norm() / want_states.norm() < 1e-2
