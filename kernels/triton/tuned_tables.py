"""Per-device tables of tuned launch shapes, written by the GPU sweep scripts.

A table is ``<dir>/<device name>.json``: keys starting with "_" are comments, every other
key names a shape. The MoE kernels (:mod:`.moe_shapes`) and the few-row linear kernel
(:mod:`.skinny_linear`) each keep one folder of them. :func:`forced` reads the
environment switches that pin one launch parameter for A/B runs inside whole steps.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The tables' file stem: the CUDA device name with spaces as underscores ("NVIDIA_H200")."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_")


def forced(name: str) -> int:
    """The launch parameter that switch ``name`` pins (warps, splits), or 0 when it is unset
    or empty. Read per call, so one benchmark process can compare values."""
    return int(os.environ.get(name) or 0)


#: a card without a table of its own uses its stand-in's: the H200 is the H100's chip (132
#: SMs, sm_90) with more and faster memory, so a shape tuned on one is near the best on the
#: other, and far better than the untuned defaults
STAND_INS = {"NVIDIA_H100_80GB_HBM3": "NVIDIA_H200", "NVIDIA_H200": "NVIDIA_H100_80GB_HBM3"}


def _table_path(folder: Path, name: str) -> Path | None:
    """``folder/name.json``, else its :data:`STAND_INS` table, else None."""
    for stem in (name, STAND_INS.get(name)):
        if stem is not None and (folder / f"{stem}.json").is_file():
            return folder / f"{stem}.json"
    return None


def read_table(folder: Path, name: str) -> dict:
    """``folder/name.json`` (else its :data:`STAND_INS` table) without its comment keys;
    empty when there is neither."""
    path = _table_path(folder, name)
    if path is None:
        return {}
    return {key: value for key, value in json.loads(path.read_text()).items() if not key.startswith("_")}


def table_to_extend(folder: Path, name: str) -> dict:
    """What a sweep on card ``name`` adds its entries to, comments kept: the card's own
    table, else a copy of its stand-in's marked ``_copied_from`` (a card's first table must
    not drop the shapes the sweep did not time, which the stand-in served until then), else
    nothing."""
    path = _table_path(folder, name)
    if path is None:
        return {}
    table = json.loads(path.read_text())
    if path.stem != name:
        table = {"_copied_from": f"{path.name}: entries a sweep on this card has not replaced", **table}
    return table


def write_table(table: dict, folder: Path, name: str, out_dir: str | None, into_tree: bool) -> list[Path]:
    """Write a sweep's ``table`` as ``<name>.json``: into ``folder`` (the source tree) when
    ``into_tree``, and into ``out_dir/<folder's name>/`` when given. The paths written."""
    text = json.dumps(table, indent=1) + "\n"
    targets = ([folder / f"{name}.json"] if into_tree else []) + (
        [Path(out_dir) / folder.name / f"{name}.json"] if out_dir else [])
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return targets
