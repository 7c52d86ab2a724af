"""scripts/ab_table.py: the comparison a `gpu_session.sh ab` call prints, each decode
figure under the variant named before it, stray lines skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import ab_table  # noqa: E402


def figure(c: int, tok_s: float, replay: float | None = 2.5) -> str:
    record = {"figure": "decode", "concurrency": c, "decode_tok_s": tok_s, "step_ms": 1000 / tok_s}
    if replay is not None:
        record["graph_replay_ms"] = replay
    return json.dumps(record)


def test_each_figure_goes_under_the_variant_before_it(tmp_path, capsys):
    lines = [figure(1, 300.0), json.dumps({"ab": "A=1", "model": "m"}), figure(1, 320.0), figure(8, 900.0, None),
             "bench timed out", json.dumps({"figure": "bandwidth", "gb_s": 3000}),
             json.dumps({"ab": "A=1+B=2", "model": "m"}), figure(1, 330.0, 2.4)]
    rows = ab_table.rows(lines)
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        ("(before any variant)", 1, 300.0, 2.5), ("A=1", 1, 320.0, 2.5), ("A=1", 8, 900.0, None),
        ("A=1+B=2", 1, 330.0, 2.4)]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(lines))
    ab_table.main(str(path))
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 5 and printed[3].split()[:3] == ["A=1", "8", "900.0"] and printed[3].endswith("-")


def test_variants_are_named_with_their_model_when_there_are_two():
    lines = [json.dumps({"ab": "A=1", "model": "m1"}), figure(1, 320.0), json.dumps({"ab": "A=1", "model": "m2"}),
             figure(1, 250.0)]
    assert [r[0] for r in ab_table.rows(lines)] == ["A=1 (m1)", "A=1 (m2)"]
