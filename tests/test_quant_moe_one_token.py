"""A single token's quantized experts (``kernels/triton/quant_moe.py`` on the one-row steps):
the launch shapes a tuned table may give them (narrow programs, words staged through
shared memory, FP8's gate and up rows in one loop) change no output beyond rounding, and
the table's lookup rules (``kernels/triton/quant_moe_shapes.py``). On CPU Triton's
interpreter runs the steps' emulation; under ``-m gpu`` their PTX runs too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from ninfer_kernels.triton import quant_moe as qm  # noqa: E402
from ninfer_kernels.triton import quant_moe_shapes as qms  # noqa: E402
from ninfer_kernels.triton import quant_tiles as qt  # noqa: E402

from test_quant_kernels import MOE_SMALL, TOL, moe_case, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _one_token_launches(monkeypatch, args, *configs) -> tuple[list, list]:
    """One token's experts under each config; and what each launch asked for: (staged, joint)
    of the gate_up launch, then the down launch's staged."""
    asked = []
    real = qm._launch

    def spy(*a, staged=0, joint=False):
        asked.append((staged, joint) if a[0] is qm._quant_gate_up_kernel else staged)
        return real(*a, staged=staged, joint=joint)

    monkeypatch.setattr(qm, "_launch", spy)
    outs = [qm.quant_fused_moe(*args, config=c) for c in configs]
    monkeypatch.undo()
    return outs, asked


def _joint_and_apart(monkeypatch, args, config=None):
    """One token's FP8 experts with gate and up rows in one staged loop (a config's ``joint``),
    then one loop after the other."""
    config = config or qms.heuristic_config(qt.FP8, 257, 9, 1)
    (joint, apart), asked = _one_token_launches(monkeypatch, args, replace(config, gate_up_staged=3, joint=True),
                                                config)
    assert asked == [(3, True), 0, (0, False), 0]  # gate_up joint, down; then both apart
    return joint, apart


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
def test_one_token_fp8_gate_and_up_rows_in_one_loop_change_nothing(monkeypatch, device):
    """The joint loop gives each row set its own block scale (gate and up rows sit in
    different 128-row blocks here) and its own words over several K steps: the same output,
    bit for bit, as the two loops, and the reference's within the tolerance."""
    args, want = moe_case("fp8", 1, torch.Generator(device=device).manual_seed(3), h=384, i=128, device=device)
    real = qm._packed
    seen: list[bool] = []
    monkeypatch.setattr(qm, "_packed", lambda *a: seen.append(real(*a)["PACKED"]) or real(*a))
    joint, apart = _joint_and_apart(monkeypatch, args, MOE_SMALL)
    assert seen == [True] * 4  # both kernels on the one-row steps, each way
    assert torch.equal(joint, apart)
    assert rel_err(joint, want.to(joint.device)) <= TOL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_one_token_experts_staged_through_shared_memory_change_nothing(monkeypatch, fmt, device):
    """A config's ``gate_up_staged`` / ``down_staged`` (the tuned one-token shapes' words
    staged through shared memory, on narrower programs): the same output, bit for bit, as
    the register prefetch on the same programs; and (the order a program's threads add a
    row's products changes with its shape on the GPU) within rounding of wider programs."""
    args, want = moe_case(fmt, 1, torch.Generator(device=device).manual_seed(4), h=384, i=128, device=device)
    narrow = replace(MOE_SMALL, gate_up=replace(MOE_SMALL.gate_up, BLOCK_N=8, num_warps=2),
                     down=replace(MOE_SMALL.down, BLOCK_N=16, num_warps=2))
    staged = replace(narrow, gate_up_staged=3, down_staged=4, joint=True)  # joint: FP8 only
    (plain, narrow_out, staged_out), asked = _one_token_launches(monkeypatch, args, MOE_SMALL, narrow, staged)
    assert asked[-2:] == [(3, True), 4]
    assert torch.equal(staged_out, narrow_out)
    assert rel_err(narrow_out, plain) <= 1e-2
    assert rel_err(staged_out, want.to(staged_out.device)) <= TOL


def test_one_token_shapes_come_from_the_device_table(monkeypatch):
    """A tuned entry serves token counts of its kind (decode or prefill) up to its own and
    not far below; the largest prefill entry anything above it; otherwise (and for other
    layers, formats or devices) the heuristic does."""
    tuned = replace(MOE_SMALL, gate_up_staged=4, joint=True)
    chunk = replace(MOE_SMALL, block_m=64, act_quant=True)
    key = qms.table_key("fp8b128x128", 257, 2048, 512, 9, torch.bfloat16)
    monkeypatch.setattr(qms, "load_table", lambda name: {key: {1: tuned, 1024: chunk}} if name == "cpu" else {})
    cpu = torch.device("cpu")

    def config(tokens, tag="fp8b128x128", fmt=qt.FP8):
        return qms.quant_moe_config(fmt, 257, 9, tokens, tag, 2048, 512, cpu)

    assert config(1) == tuned
    assert config(1024) == config(300) == config(9000) == chunk  # a chunk's, and past the largest
    for tokens in (2, 8, 100):  # a decode batch never takes the chunk's tiles; nor a short prefill
        assert config(tokens) == qms.heuristic_config(qt.FP8, 257, 9, tokens)
    assert config(1, "int4g128", qt.INT4) == qms.heuristic_config(qt.INT4, 257, 9, 1)
    assert qms.QuantMoeConfig.from_json(chunk.to_json()) == chunk


def test_counts_between_entries_take_the_heuristic_of_their_power_of_two(monkeypatch):
    """1,032 tokens (a 1,024-token chunk beside 8 decodes) lie below what an 8,192 entry
    serves: they take 2,048's heuristic blocks, which the warm-up's 2,047-token prompt
    compiled, not blocks of their own that nothing compiled before serving."""
    key = qms.table_key("fp8b128x128", 257, 2048, 512, 9, torch.bfloat16)
    big = replace(MOE_SMALL, block_m=64, act_quant=True)
    monkeypatch.setattr(qms, "load_table", lambda name: {key: {8192: big}})

    def config(tokens):
        return qms.quant_moe_config(qt.FP8, 257, 9, tokens, "fp8b128x128", 2048, 512, torch.device("cpu"))

    assert config(1032) == config(2047) == qms.heuristic_config(qt.FP8, 257, 9, 2048)
    assert qms.heuristic_config(qt.FP8, 257, 9, 1032) != config(1032)  # 1,032's own blocks differ
    assert config(2048) == big


@gpu
@needs_cuda
def test_one_token_fp8_gate_and_up_in_one_loop_at_the_35b_shape(monkeypatch):
    args, want = moe_case("fp8", 1, torch.Generator(device="cuda").manual_seed(2), e=256, h=2048, i=512, top_k=8,
                          device="cuda")
    joint, apart = _joint_and_apart(monkeypatch, args)
    assert torch.equal(joint, apart)
    assert rel_err(joint, want) <= TOL


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_one_token_moe_ptx_equals_its_emulation_at_the_35b_shape(monkeypatch, fmt):
    args, want = moe_case(fmt, 1, torch.Generator(device="cuda").manual_seed(1), e=256, h=2048, i=512, top_k=8,
                          device="cuda")
    asm = qm.quant_fused_moe(*args)
    real = qm._packed
    monkeypatch.setattr(qm, "_packed", lambda *a: {**real(*a), "EMULATE": True})
    emulated = qm.quant_fused_moe(*args)
    assert rel_err(asm, want) <= TOL and rel_err(asm, emulated) <= 1e-3
