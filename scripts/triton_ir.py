#!/usr/bin/env python3
"""Compile a Triton kernel for an NVIDIA GPU on a machine without one, and say what Triton
made of it: shared memory, registers and spills (ptxas ``-v``), which MMA, which loads were
pipelined (async copies), layout round trips through shared memory. The TTGIR goes to
``--out`` for reading.

Triton's wheel ships ptxas, so ``triton.compile`` with a ``GPUTarget`` needs no device.
Compile with the GPU machine's Triton before drawing conclusions: versions lay out and
pipeline differently (session 25: a change that saved 2% under 3.9 tripled a loop under
3.6). That version installs beside the project's without disturbing it:

    python -m pip download triton==3.6.0 --no-deps -d /tmp/wheels
    python -m pip install --no-deps --target /tmp/triton36 /tmp/wheels/triton-3.6.0-cp311-*.whl
    PYTHONPATH=/tmp/triton36 python scripts/triton_ir.py ...
Arguments are described, not passed: pointers by element type, integers by a sample value
(a value divisible by 16 gets Triton's divisibility hint, as the JIT gives it at run time,
and a value of 1 is specialised away; without the hints every load looks unaligned and
nothing is vectorised or pipelined), constexprs by value.

    python scripts/triton_ir.py ninfer_kernels.triton.kv_quant:_attend_quant_kernel \\
        --pointers '{"q_ptr": "bf16", "kd": "fp8e4nv", "vd": "fp8e4nv", "query_start_ptr": "i32", ...}' \\
        --ints '{"s_kdb": 16384, "s_kds": 1024, ...}' --floats qk_scale,k_gscale,v_gscale \\
        --constexprs '{"BLOCK_N": 64, "HALF": true, ...}' --warps 4 --stages 2 --out /tmp/attn.ttgir
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: TTGIR operations counted in the report
WATCH = (
    "ttg.async_copy_global_to_local",  # pipelined loads (cp.async into shared memory)
    "tt.load",  # plain loads into registers
    "ttng.warp_group_dot",  # Hopper warpgroup MMAs (wgmma)
    "tt.dot",  # MMAs of the older kind (mma.sync)
    "ttg.local_alloc",  # tensors stored to shared memory
    "ttg.local_load",  # tensors read back from shared memory
    "ttg.convert_layout",  # layout conversions left in registers/shared
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", help="module:function of a @triton.jit kernel")
    ap.add_argument("--pointers", default="{}", help="JSON: pointer argument -> element type (bf16, fp8e4nv, i32...)")
    ap.add_argument("--ints", default="{}", help="JSON: integer argument -> a sample value (unlisted: 7)")
    ap.add_argument("--floats", default="", help="comma-separated float arguments")
    ap.add_argument("--constexprs", default="{}", help="JSON: constexpr argument -> value")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the TTGIR here")
    ap.add_argument("--ptx", default=None, help="write the PTX here (instruction counts: grep it)")
    ap.add_argument("--sass", default=None, help="write the sm_XXa machine code here (nvdisasm of the cubin)")
    args = ap.parse_args()
    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    pointers, ints, consts = json.loads(args.pointers), json.loads(args.ints), json.loads(args.constexprs)
    floats = set(filter(None, args.floats.split(",")))
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = "*" + pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in floats:
            signature[arg] = "fp32"
        elif ints.get(arg) == 1:
            signature[arg], consts[arg] = "constexpr", 1
        else:
            signature[arg] = "i32"
            if ints.get(arg, 7) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", args.arch, 32),
                            options={"num_warps": args.warps, "num_stages": args.stages})
    ir = kernel.asm["ttgir"]
    for path, text in ((args.out, ir), (args.ptx, kernel.asm["ptx"])):
        if path:
            with open(path, "w") as f:
                f.write(text)
    if args.sass:
        Path(args.sass).write_text(sass(kernel.asm["cubin"], args.arch))
    ops = Counter(re.findall(r"\b(tt\.dot|tt\.load|ttn?g\.[a-z_]+)\b", ir))
    mma = sorted(set(re.findall(r"versionMajor = (\d)", ir)))
    print(json.dumps({"kernel": name, "shared_bytes": kernel.metadata.shared, "mma_versions": mma,
                      **registers(kernel.asm["ptx"], args.arch), **{op: ops.get(op, 0) for op in WATCH}}))


def registers(ptx: str, arch: int) -> dict:
    """Registers a thread and bytes spilled, from the ptxas Triton itself assembles with
    (``-v``): a kernel at 255 registers that spills keeps part of its tiles in local memory."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        out = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"registers": int(used.group(1)) if used else None, "spill_bytes": int(spill.group(1)) if spill else None}


def sass(cubin: bytes, arch: int) -> str:
    """The cubin disassembled by the ``nvdisasm`` shipped beside Triton's ptxas: the
    instructions a warp issues, where the PTX still hides conversions and spills."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        nvdisasm = Path(get_ptxas(arch).path).with_name("nvdisasm")
        return subprocess.run([str(nvdisasm), "-c", "-g", str(path)], capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()
