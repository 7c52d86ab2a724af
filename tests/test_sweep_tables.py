"""How the GPU sweeps update a card's tuned tables (scripts/gpu_skinny_sweep.py): the rows
they swept are replaced, everything else is kept, so a card's first table does not lose
the stand-in card's shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import gpu_skinny_sweep as sweep  # noqa: E402

from ninfer_kernels.triton import skinny_linear, tuned_tables  # noqa: E402


def test_a_linear_sweep_replaces_only_the_rows_it_swept():
    cfg = {"BLOCK_N": 64}
    table = {"_copied_from": "NVIDIA_H200.json", "A": {"1": {"old": 1}, "2": {"old": 2}}, "B": {"1": {"old": 3}},
             "C": {"8": {"old": 4}}}
    merged = sweep.merge_linear(table, {"A": {"1": cfg, "8": None}, "B": {"1": None}, "D": {"1": cfg, "8": None}})
    assert merged["A"] == {"1": cfg, "2": {"old": 2}}  # row 1 replaced, row 2 not swept
    assert "B" not in merged  # its one row went back to cuBLAS
    assert merged["C"] == {"8": {"old": 4}}  # not swept at all
    assert merged["D"] == {"1": cfg}
    assert merged["_copied_from"] and merged["_comment"] == sweep.LINEAR_COMMENT


def test_the_h100s_few_row_table_keeps_every_h200_shape_it_did_not_replace():
    h100 = tuned_tables.read_table(skinny_linear.CONFIG_DIR, "NVIDIA_H100_80GB_HBM3")
    h200 = tuned_tables.read_table(skinny_linear.CONFIG_DIR, "NVIDIA_H200")
    assert set(h200) <= set(h100)
