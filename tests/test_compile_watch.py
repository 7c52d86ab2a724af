"""The compile watch counts Triton's compiles and names the ones after the warm-up.

Triton's interpreter (CPU) compiles nothing, so the tests call the hooks the way Triton's
JIT does around a compile (``jit_cache_hook`` before, ``jit_post_compile_hook`` after)."""

from __future__ import annotations

import pytest
from loguru import logger

from ninfer.engine.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


def compile_once(name: str = "_gate_up_kernel") -> None:
    class Info:
        module, jit_function = "ninfer_kernels.triton.fused_moe", None

    info = Info()
    info.name = name
    key = ("spec", name)
    # shaped as Triton 3.6's JITFunction._call_hook passes them
    compile_info = {"key": key, "signature": {"x_ptr": "*bf16", "pairs": "i32", "rows": "i32", "BLOCK_M": "constexpr"},
                    "constants": {(3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                          (2,): [["tt.divisibility", 16]]}],
                    "num_warps": 8, "num_stages": 3}
    hook_args = dict(key=key, repr=f"{name}[...]", fn=info, compile=compile_info, is_manual_warmup=False,
                     already_compiled=False)
    assert not knobs.runtime.jit_cache_hook(**hook_args)  # a truthy answer would skip the compile
    knobs.runtime.jit_post_compile_hook(**hook_args)


@pytest.fixture
def watch():
    w = CompileWatch()
    assert w.install()
    yield w
    w.uninstall()


def test_counts_compiles_and_warns_only_once_serving(watch):
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        compile_once()
        assert watch.compiles == 1 and not warnings
        watch.serving = True
        compile_once("_down_kernel")
    finally:
        logger.remove(sink)
    assert watch.compiles == 2
    assert set(watch.by_kernel) == {"_gate_up_kernel", "_down_kernel"}
    (warning,) = warnings
    assert "fused_moe._down_kernel while serving" in warning
    assert "num_warps=8, num_stages=3; pairs: i32, rows: i32 %16, BLOCK_M=64" in warning


def test_chains_to_hooks_already_set_and_restores_them():
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("before")
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append("after")
    try:
        w = CompileWatch()
        assert w.install()
        compile_once()
        assert seen == ["before", "after"] and w.compiles == 1
        w.uninstall()
        assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook.__name__ == "<lambda>"
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_names_the_kernels_whose_compiles_took_longest_since_a_snapshot(watch):
    compile_once("_gate_up_kernel")
    before = dict(watch.by_kernel)
    for _ in range(3):
        compile_once("chunk_fwd_kernel_o")
    compile_once("_down_kernel")
    watch.by_kernel["chunk_fwd_kernel_o"] = (watch.by_kernel["chunk_fwd_kernel_o"][0], 9.0)
    text = watch.heaviest(before, top=2)
    assert text.startswith("chunk_fwd_kernel_o x3 (9.0 s), _down_kernel x1 (")
    assert "_gate_up_kernel" not in text  # compiled before the snapshot only
