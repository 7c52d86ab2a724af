"""ninfer-bench's guided-decoding overhead figure, on the tiny model."""

from __future__ import annotations

import json

from ninfer.cli import bench


def test_guided_figure_compares_equal_workloads(capsys):
    code = bench.main(["tiny:qwen3", "--device", "cpu", "--only", "guided", "--guided", "json_schema,regex",
                       "--concurrency", "2", "--decode-prompt-len", "8", "--decode-output-len", "12"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["figure"], r["guide"], r["concurrency"]) for r in lines] == [
        ("guided_decode", "json_schema", 2), ("guided_decode", "regex", 2)]
    for r in lines:
        # the guides never close, so both runs decode every requested token
        assert r["decode_tokens"] == 2 * 11
        assert r["plain_step_ms"] > 0 and r["guided_step_ms"] > 0 and r["mask_fill_us_per_step"] > 0
        assert r["overhead_ms_per_step"] == r["guided_step_ms"] - r["plain_step_ms"]
