"""Gated DeltaNet's fused token mixer: the reference against the op-by-op chain the layer
runs for prefill chunks (and ran for decode before), and the one-launch Triton kernel
against the reference (in Triton's interpreter without a GPU; the ``gpu`` test repeats it
at Qwen3.6-27B's shape and inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer_kernels import causal_conv, gated_delta, ops
from ninfer_kernels import gated_delta_decode as ref
from ninfer_plugins.models.hybrid_norms import GatedRMSNorm
from test_hybrid_kernels import state_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

EPS = 1e-6
CONV_K = 4
#: relative-norm error of the Triton op against the reference on CUDA: outputs, and the
#: float32 states (which carry bf16 conv outputs that may differ by an ulp)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
#: in the interpreter the kernel rounds to bf16 at the reference's points and the same way
#: (see the kernel's ``_round``): what differs is a rare ulp after float32 noise
INTERPRETER_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/interpreter check; the gpu test covers CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def mixer_inputs(hk: int, hv: int, d: int, tokens: int, num_slots: int, dtype, gen: torch.Generator,
                 device: str = "cpu") -> dict:
    """Random inputs of the op (Dk = Dv = d); ``proj`` is a column slice of a wider tensor
    (a row stride, as a slice of a bigger matmul output has) and the conv weight keeps
    conv1d's [C, 1, K] layout. Decays stay slow so earlier tokens matter."""
    conv_dim = 2 * hk * d + hv * d
    width = conv_dim + hv * d + 2 * hv
    wide = torch.randn(tokens, width + 5, generator=gen)
    wide[0, 3 + width - 1] = 30.0  # one softplus past torch's threshold, one far below zero
    wide[-1, 3 + width - 2] = -30.0
    return {
        "proj": wide.to(device, dtype)[:, 3 : 3 + width],
        "conv_weight": (torch.randn(conv_dim, 1, CONV_K, generator=gen) * 0.5).to(device, dtype),
        "conv_states": torch.randn(num_slots, CONV_K - 1, conv_dim, generator=gen).to(device, dtype),
        "ssm_states": (torch.randn(num_slots, hv, d, d, generator=gen) * 0.3).to(device),
        "a_log": (torch.rand(hv, generator=gen) * 0.5 + 0.05).log().to(device, dtype),
        "dt_bias": (torch.randn(hv, generator=gen) * 0.5).to(device, dtype),
        "norm_weight": (1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype),
        "num_k_heads": hk,
        "head_k_dim": d,
    }


def call(fn, inputs: dict, batch, **kwargs):
    """``fn`` on copies of the state pools: (out, conv_states, ssm_states)."""
    conv, ssm = inputs["conv_states"].clone(), inputs["ssm_states"].clone()
    args = {**inputs, "conv_states": conv, "ssm_states": ssm}
    out = fn(args["proj"], args["conv_weight"], conv, ssm, args["a_log"], args["dt_bias"], args["norm_weight"],
             EPS, args["num_k_heads"], args["head_k_dim"], batch, **kwargs)
    return out, conv, ssm


def layer_chain(inputs: dict, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op-by-op chain Gated DeltaNet's forward runs after its projection (and its prefill
    path still does), on copies of the pools: (out, conv_states, ssm_states)."""
    proj, hk, dk = inputs["proj"], inputs["num_k_heads"], inputs["head_k_dim"]
    a_log, dt_bias = inputs["a_log"], inputs["dt_bias"]
    hv, dv = a_log.shape[0], inputs["norm_weight"].shape[0]
    tokens, key_dim, value_dim = proj.shape[0], hk * dk, hv * dv
    conv, ssm = inputs["conv_states"].clone(), inputs["ssm_states"].clone()
    qkv, z, b, a = proj.split([2 * key_dim + value_dim, value_dim, hv, hv], dim=-1)
    qkv = causal_conv.causal_conv1d(qkv, inputs["conv_weight"][:, 0], conv, batch)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    out = gated_delta.gated_delta_rule(q.reshape(tokens, hk, dk), k.reshape(tokens, hk, dk),
                                       v.reshape(tokens, hv, dv), g, beta, ssm, batch)
    norm = GatedRMSNorm(dv, EPS)
    norm.weight.data = inputs["norm_weight"]
    out = norm(out.reshape(-1, dv), z.reshape(-1, dv))
    return out.reshape(tokens, value_dim), conv, ssm


# -- the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_layer_op_by_op(dtype):
    gen = torch.Generator().manual_seed(0)
    specs = [(5, 1), (0, 1), (7, 3), (1, 2), (0, 6), (40, 1)]
    inputs = mixer_inputs(2, 6, 8, sum(n for _, n in specs) + 1, 8, dtype, gen)
    batch = state_batch(specs, [3, 0, 5, 7, 2, 1], pad_rows=1)
    want, want_conv, want_ssm = layer_chain(inputs, batch)
    out, conv, ssm = call(ref.gated_delta_decode, inputs, batch)
    assert out.dtype == dtype and out.shape == want.shape
    assert (out.float() - want.float()).abs().max() <= 1e-6
    assert (conv.float() - want_conv.float()).abs().max() <= 1e-6
    assert (ssm - want_ssm).abs().max() <= 1e-6
    assert out[-1].abs().max() == 0, "rows past the last sequence are zeros"


def test_reference_negative_slot_starts_from_zero_and_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    inputs = mixer_inputs(2, 4, 8, 4, 3, torch.float32, gen)
    batch = state_batch([(4, 1), (6, 2), (2, 1)], [2, -1, 0])
    out, conv, ssm = call(ref.gated_delta_decode, inputs, batch)
    assert torch.equal(conv[1], inputs["conv_states"][1]) and torch.equal(ssm[1], inputs["ssm_states"][1])
    # the padding sequence alone, against a zeroed pool
    alone = {**inputs, "proj": inputs["proj"][1:3], "conv_states": torch.zeros_like(inputs["conv_states"][:1]),
             "ssm_states": torch.zeros_like(inputs["ssm_states"][:1])}
    want, _, _ = call(ref.gated_delta_decode, alone, state_batch([(6, 2)], [0]))
    assert torch.equal(out[1:3], want)
    # the live sequences as if the padding one were not there
    rows = torch.tensor([0, 3])
    live = {**inputs, "proj": inputs["proj"][rows]}
    want, want_conv, want_ssm = call(ref.gated_delta_decode, live, state_batch([(4, 1), (2, 1)], [2, 0]))
    assert torch.equal(out[rows], want) and torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)


def test_missing_state_slots_is_an_error_and_cpu_takes_the_reference():
    gen = torch.Generator().manual_seed(2)
    inputs = mixer_inputs(1, 1, 4, 1, 1, torch.float32, gen)
    batch = state_batch([(0, 1)], [0])
    batch.state_slots = None
    with pytest.raises(ValueError, match="state_slots"):
        call(ref.gated_delta_decode, inputs, batch)
    assert ops.choose("gated_delta_decode", "cpu") is ref.gated_delta_decode


# -- the Triton kernel against the reference ---------------------------------------------------

#: name -> (key heads, value heads, (tokens already in the state, new tokens) and slot per sequence)
CASES = {
    # decode rows continuing from random states, three value heads per key head
    "decode": (2, 6, [(5, 1), (9, 1), (3, 1)], [4, 0, 2]),
    # a fresh sequence (its slot holds stale garbage to ignore) next to one continuing
    "fresh": (2, 6, [(0, 1), (4, 1)], [1, 3]),
    # verify-like chunks: 2-4 tokens over cached history, some shorter than K - 1 (the
    # history shifts partly), one whose cache is shorter than K - 1, one fresh
    "verify": (2, 4, [(7, 3), (1, 2), (12, 4), (0, 2), (2, 1)], [3, 0, 4, 1, 2]),
    # a graph padding sequence (negative slot) between live ones, and a padding row
    "padding": (2, 6, [(3, 1), (6, 1), (8, 2)], [2, -1, 0]),
}


@cpu_only
@pytest.mark.parametrize("splits", [1, 2], ids=["whole-heads", "split-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case, dtype, splits):
    pytest.importorskip("triton")
    from ninfer_kernels.triton import counters as counters_module
    from ninfer_kernels.triton import gated_delta_decode as tri

    hk, hv, specs, slots = CASES[case]
    gen = torch.Generator().manual_seed(3)
    inputs = mixer_inputs(hk, hv, 8, sum(n for _, n in specs) + 1, 5, dtype, gen)
    batch = state_batch(specs, slots, pad_rows=1)
    if case == "decode":
        batch.seq_lens = batch.seq_lens.long()  # as replayed decode graphs hold them
    want, want_conv, want_ssm = call(ref.gated_delta_decode, inputs, batch)
    runs = 2 if dtype == torch.float32 else 1  # the same call twice: the counters were reset
    for _ in range(runs):
        got, conv, ssm = call(tri.gated_delta_decode, inputs, batch, value_splits=splits)
        assert got.dtype == dtype
        assert rel_err(got, want) <= INTERPRETER_TOL[dtype]
        assert torch.equal(got[-1], torch.zeros_like(got[-1])), "rows past the last sequence are zeros"
        assert torch.equal(conv, want_conv), "conv history: exactly the reference's, untouched slots included"
        written = sorted(s for s in slots if s >= 0)
        untouched = [s for s in range(ssm.shape[0]) if s not in written]
        assert torch.equal(ssm[untouched], inputs["ssm_states"][untouched])
        assert rel_err(ssm[written], want_ssm[written]) <= INTERPRETER_TOL[dtype]
    counters = counters_module._buffers[("gated_delta_decode", torch.device("cpu"))]
    assert not counters.any(), "counters are left at zero for the next call"


def test_launch_shape_splits_small_batches_and_takes_a_forced_count(monkeypatch):
    pytest.importorskip("triton")
    from ninfer_kernels.triton import gated_delta_decode as tri

    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    monkeypatch.delenv("NINFER_GDN_VALUE_SPLITS", raising=False)
    monkeypatch.delenv("NINFER_GDN_WARPS", raising=False)
    assert tri.launch_shape(1, 32, 128, cuda) == (4, 4)  # the 35B-A3B at batch 1: 32 columns a program
    assert tri.launch_shape(64, 32, 128, cuda) == (tri.NUM_WARPS, 1)  # enough programs already
    assert tri.launch_shape(1, 32, 128, torch.device("cpu")) == (tri.NUM_WARPS, 1)
    monkeypatch.setenv("NINFER_GDN_VALUE_SPLITS", "8")
    assert tri.launch_shape(1, 32, 128, cuda) == (4, 8)
    assert tri.launch_shape(1, 32, 4, cuda) == (4, 4)  # never more splits than columns
    monkeypatch.setenv("NINFER_GDN_WARPS", "2")
    assert tri.launch_shape(1, 32, 128, cuda) == (2, 8)


@cpu_only
def test_triton_steps_chain_like_the_reference():
    """A verify step, then decode on the states it left: the history each program wrote is
    what the next call reads (a group of two, so the counter decides who writes q/k)."""
    pytest.importorskip("triton")
    from ninfer_kernels.triton import gated_delta_decode as tri

    gen = torch.Generator().manual_seed(4)
    first = mixer_inputs(2, 4, 8, 5, 3, torch.float32, gen)
    second = mixer_inputs(2, 4, 8, 2, 3, torch.float32, gen)
    states = {}
    runs = {"ref": (ref.gated_delta_decode, {}), "whole": (tri.gated_delta_decode, {}),
            "split": (tri.gated_delta_decode, {"value_splits": 4})}
    for name, (fn, kwargs) in runs.items():
        _, conv, ssm = call(fn, first, state_batch([(6, 3), (0, 2)], [2, 0]), **kwargs)
        out, conv, ssm = call(fn, {**second, "conv_states": conv, "ssm_states": ssm},
                              state_batch([(9, 1), (2, 1)], [2, 0]), **kwargs)
        states[name] = out, conv, ssm
    want, want_conv, want_ssm = states["ref"]
    for name in ("whole", "split"):
        got, conv, ssm = states[name]
        assert rel_err(got, want) <= TOL[torch.float32], name
        assert torch.equal(conv, want_conv), name
        assert rel_err(ssm, want_ssm) <= TOL[torch.float32], name


# -- speculative verify rows: the state after every position, the working slot only read ------

#: (tokens already in the state, verify width) and working slot per sequence; rows 6.. are scratch
VERIFY_SPECS, VERIFY_SLOTS = [(7, 4), (1, 4), (12, 4)], [3, 0, 4]


def verify_call(fn, inputs: dict, **kwargs):
    """``fn`` (a ``gated_delta_verify``) over VERIFY_SPECS: (out, conv, ssm, position rows)."""
    n, width = len(VERIFY_SPECS), VERIFY_SPECS[0][1]
    rows = torch.arange(6, 6 + n * width, dtype=torch.int64).view(n, width)
    batch = state_batch(VERIFY_SPECS, VERIFY_SLOTS)
    out, conv, ssm = call(fn, inputs, batch, position_rows=rows, **kwargs)
    return out, conv, ssm, rows


def test_reference_verify_keeps_every_prefix_and_leaves_the_slot():
    """Position t's row holds what decoding the first t + 1 tokens as one chunk leaves."""
    gen = torch.Generator().manual_seed(6)
    inputs = mixer_inputs(2, 4, 8, 12, 6 + 12, torch.float32, gen)
    out, conv, ssm, rows = verify_call(ref.gated_delta_verify, inputs)
    assert torch.equal(conv[:6], inputs["conv_states"][:6]) and torch.equal(ssm[:6], inputs["ssm_states"][:6])
    for t in range(4):
        picks = torch.tensor([i * 4 + j for i in range(3) for j in range(t + 1)])
        prefix = state_batch([(c, t + 1) for c, _ in VERIFY_SPECS], VERIFY_SLOTS)
        want, want_conv, want_ssm = call(ref.gated_delta_decode, {**inputs, "proj": inputs["proj"][picks]}, prefix)
        # (a chunk sums in another order than token steps: float32 noise only)
        assert rel_err(out.view(3, 4, -1)[:, : t + 1].reshape(len(picks), -1), want) <= 1e-6
        assert torch.equal(conv[rows[:, t]], want_conv[VERIFY_SLOTS])
        assert rel_err(ssm[rows[:, t]], want_ssm[VERIFY_SLOTS]) <= 1e-6


@cpu_only
@pytest.mark.parametrize("splits", [1, 2], ids=["whole-heads", "split-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_verify_matches_reference(dtype, splits):
    pytest.importorskip("triton")
    from ninfer_kernels.triton import gated_delta_decode as tri

    gen = torch.Generator().manual_seed(7)
    inputs = mixer_inputs(2, 4, 8, 12, 6 + 12, dtype, gen)
    want, want_conv, want_ssm, _ = verify_call(ref.gated_delta_verify, inputs)
    got, conv, ssm, _ = verify_call(tri.gated_delta_verify, inputs, value_splits=splits)
    assert rel_err(got, want) <= INTERPRETER_TOL[dtype]
    assert torch.equal(conv, want_conv), "every position's conv history, exactly; other rows untouched"
    assert torch.equal(ssm[:6], inputs["ssm_states"][:6]), "the working slots are only read"
    assert rel_err(ssm[6:], want_ssm[6:]) <= INTERPRETER_TOL[dtype]


# -- CUDA: Qwen3.6-27B's shape (16 key heads, 48 value heads, head dims 128), bf16 ---------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_real_shape_and_cuda_graph(splits):
    import functools

    from ninfer_kernels.triton import gated_delta_decode as module

    class tri:  # the module's op at a fixed launch shape
        gated_delta_decode = functools.partial(module.gated_delta_decode, value_splits=splits)

    gen = torch.Generator().manual_seed(5)
    specs = [(2047, 1)] * 6 + [(100, 4), (0, 1)]
    slots = [0, 1, 2, -1, 3, 4, 5, 6]
    inputs = mixer_inputs(16, 48, 128, sum(n for _, n in specs), 8, torch.bfloat16, gen, device="cuda")
    batch = state_batch(specs, slots, device="cuda")
    want, want_conv, want_ssm = call(ref.gated_delta_decode, inputs, batch)
    got, conv, ssm = call(tri.gated_delta_decode, inputs, batch)
    assert rel_err(got, want) <= TOL[torch.bfloat16]
    assert torch.equal(conv, want_conv)
    assert rel_err(ssm, want_ssm) <= STATE_TOL[torch.bfloat16]
    assert torch.equal(ssm[7], inputs["ssm_states"][7])

    # captured once, replayed from the same starting states: the eager result, bit for bit
    static = {**inputs, "conv_states": inputs["conv_states"].clone(), "ssm_states": inputs["ssm_states"].clone()}
    args = lambda: (static["proj"], static["conv_weight"], static["conv_states"], static["ssm_states"],  # noqa: E731
                    static["a_log"], static["dt_bias"], static["norm_weight"], EPS, 16, 128, batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.gated_delta_decode(*args())  # compiles, and allocates the counters before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = tri.gated_delta_decode(*args())
    for _ in range(2):
        static["conv_states"].copy_(inputs["conv_states"])
        static["ssm_states"].copy_(inputs["ssm_states"])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got)
        assert torch.equal(static["conv_states"], conv) and torch.equal(static["ssm_states"], ssm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 4])
def test_real_shape_verify(splits):
    """Verify rows at the 27B shape (batch 2, width 4) against the reference on CUDA."""
    from ninfer_kernels.triton import gated_delta_decode as module

    gen = torch.Generator().manual_seed(8)
    specs, slots = [(2047, 4), (100, 4)], [0, 1]
    inputs = mixer_inputs(16, 48, 128, 8, 2 + 9, torch.bfloat16, gen, device="cuda")
    rows = torch.arange(2, 10, dtype=torch.int64, device="cuda").view(2, 4)
    batch = state_batch(specs, slots, device="cuda")
    want, want_conv, want_ssm = call(ref.gated_delta_verify, inputs, batch, position_rows=rows)
    got, conv, ssm = call(module.gated_delta_verify, inputs, batch, position_rows=rows, value_splits=splits)
    assert rel_err(got, want) <= TOL[torch.bfloat16]
    assert torch.equal(conv, want_conv)
    assert torch.equal(ssm[:2], inputs["ssm_states"][:2]) and torch.equal(ssm[10], inputs["ssm_states"][10])
    assert rel_err(ssm[2:10], want_ssm[2:10]) <= STATE_TOL[torch.bfloat16]
