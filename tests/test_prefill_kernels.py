"""Prefill kernels of Gated DeltaNet: the token-parallel Triton conv and the one-pass gated
RMSNorm against their references (in Triton's interpreter without a GPU), and at Qwen3.6-27B
shapes on CUDA.

In the interpreter, fp32 -> bf16 casts truncate where the GPU rounds to nearest, so bf16
outputs are compared to within one bf16 step; float32 conv outputs are compared bit for bit
against the reference with its ``silu`` computed as the kernel does (numpy's ``exp``).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from ninfer_kernels import causal_conv
from ninfer_kernels.gated_rms_norm import gated_rms_norm
from ninfer_plugins.models.hybrid_norms import GatedRMSNorm
from test_hybrid_kernels import state_batch

triton = pytest.importorskip("triton")
from ninfer_kernels.triton import causal_conv as t_conv  # noqa: E402
from ninfer_kernels.triton import gated_rms_norm as t_norm  # noqa: E402
from ninfer_kernels.triton import gdn_gates as t_gates  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/interpreter check; gpu tests cover CUDA")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_STEP = 2**-7  # relative spacing of bfloat16 values
#: (tokens already in the state, new tokens): chunks over several 64-token blocks, chunks
#: shorter than K - 1 continuing from history, fresh sequences and decode rows in one batch
MIXED = [(5, 150), (0, 99), (7, 1), (9, 2), (0, 2), (3, 70), (0, 1), (2, 1), (1, 64), (0, 129)]


def _numpy_silu(t: torch.Tensor) -> torch.Tensor:
    a = t.numpy()
    return torch.from_numpy(a / (np.float32(1.0) + np.exp(-a)))


@pytest.fixture
def kernel_silu(monkeypatch):
    """The reference conv with the interpreter's silu: then float32 results match bit for bit."""
    monkeypatch.setattr(causal_conv, "F", types.SimpleNamespace(silu=_numpy_silu))


def _conv_case(specs, slots, channels, dtype, gen, pad_rows=3, num_slots=None):
    tokens = sum(n for _, n in specs)
    wide = torch.randn(tokens + pad_rows, channels + 40, generator=gen).to(dtype)
    x = wide[:, 16 : 16 + channels]  # a column slice of a wider projection, as in the model
    weight = (torch.randn(channels, 4, generator=gen) * 0.5).to(dtype)
    states = torch.randn(num_slots or len(specs) + 1, 3, channels, generator=gen).to(dtype)
    return x, weight, states, state_batch(specs, slots, pad_rows=pad_rows)


def _both(x, weight, states, batch, **kw):
    want_states, got_states = states.clone(), states.clone()
    want = causal_conv.causal_conv1d(x, weight, want_states, batch)
    got = t_conv.causal_conv1d(x, weight, got_states, batch, **kw)
    return got, want, got_states, want_states


@cpu_only
@pytest.mark.parametrize("block_t", [64, 16])
def test_conv_float32_is_bit_exact(kernel_silu, block_t):
    gen = torch.Generator().manual_seed(0)
    case = _conv_case(MIXED, [3, 0, 7, 1, 2, 9, 4, 5, 8, 6], 160, torch.float32, gen, num_slots=11)
    got, want, got_states, want_states = _both(*case, block_t=block_t)
    assert torch.equal(got, want)
    assert torch.equal(got_states, want_states)
    assert got[-3:].abs().max() == 0, "padding rows stay zero"


@cpu_only
def test_conv_bf16_within_one_step():
    gen = torch.Generator().manual_seed(1)
    case = _conv_case(MIXED, list(range(10)), 136, torch.bfloat16, gen)
    got, want, got_states, want_states = _both(*case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=1e-6)
    assert torch.equal(got_states, want_states)


@cpu_only
def test_conv_decode_only_batch(kernel_silu):
    """One row per sequence: the kernel's one-row blocks (the grid of the old kernel)."""
    gen = torch.Generator().manual_seed(2)
    case = _conv_case([(4, 1), (0, 1), (1, 1), (30, 1), (2, 1)], [4, 2, 0, 1, 3], 64, torch.float32, gen, pad_rows=2)
    got, want, got_states, want_states = _both(*case)
    assert torch.equal(got, want)
    assert torch.equal(got_states, want_states)


@cpu_only
def test_conv_steps_carry_state(kernel_silu):
    """Step after step (each step's states feeding the next), the kernel tracks the reference."""
    gen = torch.Generator().manual_seed(3)
    steps = [{0: 150, 1: 1}, {0: 2, 1: 130, 2: 1}, {0: 1, 1: 2, 2: 70}, {0: 66, 1: 1, 2: 1}]
    want_states = torch.randn(3, 3, 48, generator=gen)
    got_states = want_states.clone()
    weight = torch.randn(48, 4, generator=gen)
    done = [0, 0, 0]
    for step in steps:
        seqs = list(step)
        batch = state_batch([(done[i], step[i]) for i in seqs], seqs)
        x = torch.randn(sum(step.values()), 48, generator=gen)
        want = causal_conv.causal_conv1d(x, weight, want_states, batch)
        got = t_conv.causal_conv1d(x, weight, got_states, batch)
        assert torch.equal(got, want)
        assert torch.equal(got_states, want_states)
        for i in seqs:
            done[i] += step[i]


@cpu_only
@pytest.mark.parametrize("length", [1, 2, 100])
def test_conv_negative_slot_reads_zeros_and_writes_nothing(kernel_silu, length):
    """A graph padding row (slot -1) starts from zero history even mid-sequence, and leaves
    every slot alone (not least the last one, which -1 would index in Python)."""
    gen = torch.Generator().manual_seed(4)
    x, weight, states, batch = _conv_case([(6, 5), (9, length), (0, 70)], [0, -1, 1], 40, torch.float32, gen)
    before = states.clone()
    got = t_conv.causal_conv1d(x, weight, states, batch)
    assert torch.equal(states[2:], before[2:])
    # the padding sequence as a fresh one, on a scratch slot; the others as they are
    fresh = state_batch([(6, 5), (0, length), (0, 70)], [0, 2, 1], pad_rows=3)
    want_states = before.clone()
    want = causal_conv.causal_conv1d(x, weight, want_states, fresh)
    assert torch.equal(got, want)
    assert torch.equal(states[:2], want_states[:2])


# -- gated RMSNorm ---------------------------------------------------------------------------


def _norm_inputs(tokens, heads, dim, dtype, gen):
    x = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    proj = torch.randn(tokens, heads * dim + 24, generator=gen).to(dtype) * 2
    z = proj[:, 8 : 8 + heads * dim]  # the gate: a column slice of the input projection
    return x, z


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float32)])
def test_gated_norm_reference_is_the_module(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(5)
    x, z = _norm_inputs(7, 6, 128, dtype, gen)
    module = GatedRMSNorm(128, 1e-6)
    module.weight.data = (torch.rand(128, generator=gen) + 0.5).to(weight_dtype)
    want = module(x.reshape(-1, 128), z.reshape(-1, 128))
    assert torch.equal(gated_rms_norm(x.reshape(-1, 128), z.reshape(-1, 128), module.weight, 1e-6), want)
    assert torch.equal(gated_rms_norm(x, z.unflatten(-1, (6, 128)), module.weight, 1e-6).reshape(-1, 128), want)


@cpu_only
@pytest.mark.parametrize("dtype,weight_dtype,dim", [(torch.bfloat16, torch.bfloat16, 128),
                                                    (torch.bfloat16, torch.float32, 128),
                                                    (torch.float32, torch.float32, 96)])
def test_gated_norm_triton_matches_reference(dtype, weight_dtype, dim):
    gen = torch.Generator().manual_seed(6)
    x, z = _norm_inputs(13, 5, dim, dtype, gen)  # 65 rows: a partial last block of 32
    weight = (torch.rand(dim, generator=gen) + 0.5).to(weight_dtype)
    gate = z.unflatten(-1, (5, dim))
    want = gated_rms_norm(x, gate, weight, 1e-6)
    got = t_norm.gated_rms_norm(x, gate, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the interpreter truncates each of up to three roundings: within a few bf16 steps
        torch.testing.assert_close(got.float(), want.float(), rtol=3 * BF16_STEP, atol=1e-2)
    flat = t_norm.gated_rms_norm(x.reshape(-1, dim), z.reshape(-1, dim), weight, 1e-6)
    assert torch.equal(flat, got.reshape(-1, dim))


# -- CUDA: Qwen3.6-27B's prefill shapes (10240 conv channels; 48 value heads of 128) ----------


@gpu
@needs_cuda
def test_conv_27b_prefill_shape():
    gen = torch.Generator().manual_seed(7)
    specs = [(0, 8192)], [(3000, 500), (100, 1), (0, 300), (7, 2)]
    for spec in specs:
        tokens = sum(n for _, n in spec)
        x = torch.randn(tokens, 10240, generator=gen).to("cuda", torch.bfloat16)
        weight = (torch.randn(10240, 4, generator=gen) * 0.3).to("cuda", torch.bfloat16)
        states = torch.randn(len(spec), 3, 10240, generator=gen).to("cuda", torch.bfloat16)
        batch = state_batch(spec, list(range(len(spec))), device="cuda")
        got, want, got_states, want_states = _both(x, weight, states, batch)
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=1e-5)
        assert torch.equal(got_states, want_states)


@gpu
@needs_cuda
def test_gated_norm_27b_prefill_shape():
    gen = torch.Generator().manual_seed(8)
    x, z = (t.cuda() for t in _norm_inputs(8192, 48, 128, torch.bfloat16, gen))
    weight = (torch.rand(128, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    gate = z.unflatten(-1, (48, 128))
    want = gated_rms_norm(x, gate, weight, 1e-6)
    got = t_norm.gated_rms_norm(x, gate, weight, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_STEP, atol=1e-3)
    assert (got.float() - want.float()).norm() / want.float().norm() < 5e-3


@pytest.mark.parametrize("split", [(16, 16, 32), (24, 40)])
def test_conv_split_output_equals_the_split_reference(split):
    """The conv writes q, k and v straight into their own contiguous tensors."""
    gen = torch.Generator().manual_seed(len(split))
    x, weight, states, batch = _conv_case([(0, 9), (4, 1), (3, 5)], [2, 0, 1], 64, torch.float32, gen, pad_rows=2)
    got_states = states.clone()
    want = causal_conv.causal_conv1d(x, weight, states.clone(), batch)
    got = t_conv.causal_conv1d(x, weight, got_states, batch, split=split)
    assert [p.shape[1] for p in got] == list(split) and all(p.is_contiguous() for p in got)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-6)
    ref_parts = causal_conv.causal_conv1d(x, weight, states.clone(), batch, split=split)
    for a, b in zip(ref_parts, want.split(list(split), dim=1)):
        assert a.is_contiguous() and torch.equal(a, b)
    with pytest.raises(ValueError, match="adding up"):
        t_conv.causal_conv1d(x, weight, got_states, batch, split=(10, 10))


def _gate_inputs(tokens: int, heads: int, dtype: torch.dtype, gen: torch.Generator):
    """``a`` and ``b`` as the model takes them (column slices of a projection row), with
    values past softplus's threshold and far below zero among them; ``A_log``, ``dt_bias``."""
    proj = (torch.randn(tokens, 3 * heads + 5, generator=gen) * 8).to(dtype)
    proj[0, :heads] = torch.linspace(-40, 40, heads).to(dtype)
    a, b = proj[:, 5 : 5 + heads], proj[:, 5 + heads : 5 + 2 * heads]
    a_log = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    return a, b, a_log, dt_bias


def _check_gates(got, want, dtype, beta_rtol: float) -> None:
    (g, beta), (g_ref, beta_ref) = got, want
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == g_ref.shape
    # the kernel's log(1 + exp(x)) drops what log1p keeps of a tiny exp(x): absolute slack there;
    # a GPU's exp and log are approximate to a few ulps as well (1.3e-6 seen on an H100)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6 if g.device.type == "cpu" else 1e-5)
    torch.testing.assert_close(beta.float(), beta_ref.float(), rtol=beta_rtol, atol=0)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 70, 129])
def test_gdn_gates_triton_matches_reference(dtype, tokens):
    """One launch for what the layer computed in about seven torch ops, on the strided
    ``a`` and ``b`` slices, over several token blocks and a ragged last one."""
    from ninfer_kernels.gated_delta import gdn_gates

    a, b, a_log, dt_bias = _gate_inputs(tokens, 6, dtype, torch.Generator().manual_seed(tokens))
    # bf16 beta is the reference's exactly: the same float32 sigmoid, rounded to nearest
    _check_gates(t_gates.gdn_gates(a, b, a_log, dt_bias), gdn_gates(a, b, a_log, dt_bias), dtype,
                 beta_rtol=0 if dtype == torch.bfloat16 else 1e-6)


@gpu
@needs_cuda
def test_gdn_gates_27b_prefill_shape():
    from ninfer_kernels.gated_delta import gdn_gates

    a, b, a_log, dt_bias = (t.cuda() for t in _gate_inputs(8192, 48, torch.bfloat16, torch.Generator().manual_seed(3)))
    # the GPU's exp may move a float32 sigmoid across a bf16 rounding point: one step
    _check_gates(t_gates.gdn_gates(a, b, a_log, dt_bias), gdn_gates(a, b, a_log, dt_bias), torch.bfloat16,
                 beta_rtol=BF16_STEP)
