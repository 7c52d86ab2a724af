"""ninfer-train on CUDA: the captured training step (ninfer/train/graphed_step.py) trains
as the eager loop does."""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer.train.presets import PRESETS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_captured_steps_train_as_the_eager_loop(monkeypatch):
    """Three eager steps, the capture, then replays: the weights after eight steps equal the
    eager loop's (micro-batches and a changing MTP offset included), and they moved."""
    from ninfer.train.checkpoint import hf_config
    from ninfer.train.loop import train
    from ninfer.train.pipeline import build_model

    preset = attrs.evolve(PRESETS["test"], steps=8, micro_batch=4, warmup=2)
    device = torch.device("cuda")
    config = hf_config(preset, {"vocab_size": 384, "eos_token_id": 1, "pad_token_id": 0})
    stream = torch.randint(0, 384, (8192,), generator=torch.Generator().manual_seed(0))
    start = {n: t.clone() for n, t in build_model(config, preset, 0, device).state_dict().items()}
    trained = []
    for graph in ("1", "0"):
        monkeypatch.setenv("NINFER_TRAIN_GRAPH", graph)
        model = build_model(config, preset, 0, device)
        out = train(model, stream, preset, 0, device)
        assert out["graphed"] is (graph == "1") and out["steps"] == preset.steps
        trained.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    moved = 0
    for name, eager in trained[1].items():
        torch.testing.assert_close(trained[0][name], eager, rtol=1e-3, atol=1e-5, msg=name)
        moved += not torch.equal(eager, start[name])
    assert moved > len(start) // 2


def test_fla_delta_rule_trains_as_the_float32_recurrence():
    """``NINFER_TRAIN_FLA=1``: fla's chunked kernels give the outputs and gradients of the
    float32 chunked rule, within bf16 rounding (two key heads shared by four value heads)."""
    import types

    from ninfer.train.model import GatedDeltaNet, _fla_chunk, fla_delta_rule

    if _fla_chunk() is None:
        pytest.skip("flash-linear-attention is not importable")
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, n, hk, hv, dk, dv = 2, 200, 2, 4, 64, 64
    args = (torch.randn(b, n, hk, dk, device="cuda", generator=gen).bfloat16(),
            torch.randn(b, n, hk, dk, device="cuda", generator=gen).bfloat16(),
            torch.randn(b, n, hv, dv, device="cuda", generator=gen).bfloat16(),
            -torch.rand(b, n, hv, device="cuda", generator=gen) * 0.5,
            torch.rand(b, n, hv, device="cuda", generator=gen))
    weight = torch.randn(b, n, hv, dv, device="cuda", generator=gen)
    heads = types.SimpleNamespace(hv=hv, dv=dv)  # all the float32 rule reads of its layer
    outs, grads = [], []
    for run in (fla_delta_rule, lambda *a: GatedDeltaNet._recurrence(heads, *a, None)):
        leaves = [t.detach().clone().requires_grad_() for t in args]
        out = run(*leaves).float()
        (out * weight).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.float() for t in leaves])
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for name, fla_grad, ref_grad in zip("q k v g beta".split(), *grads):
        torch.testing.assert_close(fla_grad, ref_grad, rtol=5e-2, atol=5e-2, msg=name)
