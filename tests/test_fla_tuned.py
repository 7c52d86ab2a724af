"""The tuned table for flash-linear-attention's autotuners: what it pins, and what it leaves
to autotuning. fla itself runs only on a GPU, so a stand-in module under the ``fla.``
prefix holds real Triton autotuners, one of them under a heuristics wrapper as fla's are."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ninfer_kernels.triton import fla_tuned  # noqa: E402

CANDIDATES = [triton.Config({"BT": bt}, num_warps=w) for bt in (16, 32) for w in (2, 4)]


@triton.autotune(configs=CANDIDATES, key=["H", "K"])
@triton.jit
def scale_kernel(x, H, K: tl.constexpr, BT: tl.constexpr):
    pass


@triton.heuristics({"EVEN": lambda args: args["K"] % 2 == 0})
@triton.autotune(configs=CANDIDATES, key=["K"])
@triton.jit
def wrapped_kernel(x, K: tl.constexpr, BT: tl.constexpr, EVEN: tl.constexpr):
    pass


@triton.autotune(configs=CANDIDATES, key=["K"])
@triton.jit
def namesake_kernel(x, K: tl.constexpr, BT: tl.constexpr):
    pass


# fla defines some kernels under one name in several modules (recompute_w_u_fwd_kernel in five)
namesake_kernel.base_fn.__module__, namesake_kernel.base_fn.__name__ = "fla.ops.other", "scale_kernel"
SCALE, WRAPPED = fla_tuned.kernel_name(scale_kernel), fla_tuned.kernel_name(wrapped_kernel.fn)


def entry(key, bt, warps):
    return {"key": key, "config": {"kwargs": {"BT": bt}, "num_warps": warps, "num_stages": 3, "num_ctas": 1,
                                   "maxnreg": None}}


@pytest.fixture
def fake_fla(monkeypatch, tmp_path):
    module = types.ModuleType("fla.ops.fake")
    module.scale_kernel, module.wrapped_kernel = scale_kernel, wrapped_kernel
    other = types.ModuleType("fla.ops.other")
    other.scale_kernel = namesake_kernel
    monkeypatch.setitem(sys.modules, "fla.ops.fake", module)
    monkeypatch.setitem(sys.modules, "fla.ops.other", other)
    monkeypatch.setattr(fla_tuned, "FOLDER", tmp_path)
    monkeypatch.setattr(fla_tuned, "device_name", lambda device: "FAKE_CARD")
    monkeypatch.delenv("NINFER_FLA_PIN", raising=False)
    for kernel in (scale_kernel, wrapped_kernel.fn, namesake_kernel):
        kernel.cache.clear()
    yield tmp_path
    for kernel in (scale_kernel, wrapped_kernel.fn, namesake_kernel):
        kernel.cache.clear()


def test_finds_fla_autotuners_under_heuristics_wrappers_by_module_and_name(fake_fla):
    found = fla_tuned.autotuners()
    assert found[SCALE] is scale_kernel and found[WRAPPED] is wrapped_kernel.fn
    assert SCALE.endswith(".scale_kernel") and found["fla.ops.other.scale_kernel"] is namesake_kernel


def test_pins_the_table_keys_with_the_autotuners_own_candidates_only(fake_fla):
    table = {
        "_about": "a comment",
        SCALE: [entry([8, 64, "torch.bfloat16"], 32, 4),
                entry([8, 128, "torch.bfloat16"], 64, 4)],  # BT=64 is no candidate: skipped
        WRAPPED: [entry([128, "torch.float32"], 16, 2)],
        "fla.ops.fake.gone_kernel": [entry([1], 16, 2)],  # a kernel this fla no longer has
        "scale_kernel": [entry([8, 64, "torch.bfloat16"], 16, 2)],  # a bare name matches no one
    }
    (fake_fla / "FAKE_CARD.json").write_text(json.dumps(table))
    assert fla_tuned.pin(torch.device("cuda")) == 2
    assert set(scale_kernel.cache) == {(8, 64, "torch.bfloat16")}
    pinned = scale_kernel.cache[(8, 64, "torch.bfloat16")]
    assert any(pinned is c for c in scale_kernel.configs)  # the candidate itself, hooks and all
    assert pinned.kwargs == {"BT": 32} and pinned.num_warps == 4
    assert wrapped_kernel.fn.cache[(128, "torch.float32")].num_warps == 2
    assert not namesake_kernel.cache  # its namesake's entries are not its own
    # what the autotuners hold reads back as the same entries
    assert fla_tuned.tuned() == {SCALE: [entry([8, 64, "torch.bfloat16"], 32, 4)],
                                 WRAPPED: [entry([128, "torch.float32"], 16, 2)]}


def test_pins_nothing_when_turned_off_on_cpu_or_without_a_table(fake_fla, monkeypatch):
    assert fla_tuned.pin(torch.device("cuda")) == 0  # no table for this card
    (fake_fla / "FAKE_CARD.json").write_text(json.dumps({SCALE: [entry([8, 64, "torch.bfloat16"], 32, 4)]}))
    assert fla_tuned.pin(torch.device("cpu")) == 0
    monkeypatch.setenv("NINFER_FLA_PIN", "0")
    assert fla_tuned.pin(torch.device("cuda")) == 0
    assert not scale_kernel.cache


def test_a_merge_keeps_comments_and_replaces_a_keys_config():
    old = {"_about": "kept", "scale_kernel": [entry([8, 64], 16, 2), entry([8, 128], 16, 2)]}
    new = {"scale_kernel": [entry([8, 64], 32, 4)], "wrapped_kernel": [entry([128], 16, 2)]}
    out = fla_tuned.merged(old, new)
    assert out["_about"] == "kept"
    assert out["scale_kernel"] == [entry([8, 64], 32, 4), entry([8, 128], 16, 2)]
    assert out["wrapped_kernel"] == [entry([128], 16, 2)]
