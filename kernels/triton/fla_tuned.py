"""flash-linear-attention's autotuned kernels, their results tuned ahead of time.

fla autotunes its chunked Gated DeltaNet kernels at their first call with each new key
(head counts and dims, chunk size, dtypes): every candidate config of a kernel (4 to 25 of
them) is compiled and timed. On a machine whose Triton cache is cold that was 42 s of the
27B's 96 s startup (H100, sessions 39 and 40: 54 s with this card's table).

A table per card (``fla_configs/<device name>.json``, written by
``scripts/gpu_fla_tune.py`` from fla's own autotuning at the shapes the engine calls)
fills each autotuner's result cache before the engine's first call, for exactly the keys
it holds, and only with configs among the autotuner's own candidates. A pinned kernel
then compiles its one config; a key the table lacks autotunes as before; an fla release
whose kernels or candidates changed finds nothing to pin. ``NINFER_FLA_PIN=0`` turns the
table off (the tuning script does, to measure afresh).

Table: ``{module.kernel name: [{"key": [...], "config": {"kwargs": {...}, "num_warps": w,
"num_stages": s, "num_ctas": c, "maxnreg": r}}, ...]}``; keys starting with "_" are comments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from ninfer_kernels.triton.tuned_tables import device_name, read_table

FOLDER = Path(__file__).parent / "fla_configs"


def kernel_name(tuner: Any) -> str:
    """A table's name for an autotuner: its kernel's module and function name. fla reuses
    function names across its modules (five define ``recompute_w_u_fwd_kernel``, two
    ``chunk_fwd_kernel_o``), and by the bare name the Gated DeltaNet ones went untuned in
    session 40's first table."""
    return f"{tuner.base_fn.__module__}.{tuner.base_fn.__name__}"


def autotuners() -> dict[str, Any]:
    """fla's autotuners among the modules imported so far, by :func:`kernel_name` (an
    autotuner may sit under a ``triton.heuristics`` wrapper)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return {}
    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            tuner = _unwrap(value, Autotuner)
            if tuner is not None:
                found[kernel_name(tuner)] = tuner
    return found


def _unwrap(value: Any, kind: type) -> Any:
    """``value`` or what it wraps through ``.fn`` (heuristics -> autotuner -> jit function),
    if that is a ``kind``; None otherwise (a module's other names: functions, modules, ...)."""
    for _ in range(4):
        if isinstance(value, kind):
            return value
        try:
            value = getattr(value, "fn", None)
        except Exception:  # noqa: BLE001  (lazy modules and proxies raise more than AttributeError)
            return None
        if value is None:
            return None
    return None


def _same(config: Any, entry: dict) -> bool:
    return (config.kwargs == entry.get("kwargs", {}) and config.num_warps == entry.get("num_warps")
            and config.num_stages == entry.get("num_stages") and config.num_ctas == entry.get("num_ctas", 1)
            and config.maxnreg == entry.get("maxnreg"))


def pin(device: torch.device) -> int:
    """Fill fla's autotuner caches from ``device``'s table; the number of keys pinned."""
    if os.environ.get("NINFER_FLA_PIN", "1") == "0" or device.type != "cuda":
        return 0
    table = read_table(FOLDER, device_name(device))
    if not table:
        return 0
    tuners = autotuners()
    pinned = 0
    for kernel, entries in table.items():
        tuner = tuners.get(kernel)
        if tuner is None:
            continue
        for entry in entries:
            config = next((c for c in tuner.configs if _same(c, entry["config"])), None)
            if config is not None:
                tuner.cache.setdefault(tuple(entry["key"]), config)
                pinned += 1
    return pinned


def tuned() -> dict[str, list[dict]]:
    """What fla's autotuners have chosen in this process, as table entries (keys a JSON
    file cannot hold are left out)."""
    table: dict[str, list[dict]] = {}
    for kernel, tuner in sorted(autotuners().items()):
        entries = []
        for key, config in tuner.cache.items():
            if all(isinstance(part, (bool, int, float, str)) or part is None for part in key):
                entries.append({"key": list(key), "config": {
                    "kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
                    "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}})
        if entries:
            table[kernel] = entries
    return table


def merged(old: dict, new: dict[str, list[dict]]) -> dict:
    """``old`` (a table, comments kept) with ``new``'s entries added, a key's new config
    replacing its old one."""
    out = dict(old)
    for kernel, entries in new.items():
        by_key = {tuple(e["key"]): e for e in old.get(kernel, [])}
        by_key.update({tuple(e["key"]): e for e in entries})
        out[kernel] = list(by_key.values())
    return out
