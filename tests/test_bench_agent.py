"""``ninfer-bench --workload agent`` on the tiny model: its three runs, one line per turn
and a summary each; reuse serves the later turns from cache and changes no output."""

from __future__ import annotations

import argparse

import pytest

from ninfer.bench import agent
from ninfer.cli.bench import parse_args

pytestmark = pytest.mark.usefixtures("one_thread")


def test_agent_workload_reports_each_turn_with_and_without_reuse(tmp_path, monkeypatch):
    monkeypatch.setattr(agent, "_STANDIN_SIZES", {"claude-code": (2400, 1200, 200), "codex": (1800, 600, 100)})
    args = parse_args(["tiny:qwen3", "--device", "cpu", "--workload", "agent", "--agents", "2", "--turns", "3",
                       "--agent-prefix-tokens", "600", "--agent-result-words", "8", "--agent-output-tokens", "4",
                       "--agent-over-capacity", "3", "--agent-fixtures", str(tmp_path), "--prefill-chunk", "256"])
    assert isinstance(args, argparse.Namespace) and args.workload == "agent"
    rows: list[dict] = []
    agent.agent_workload(args, rows.append)
    turns = {(r["run"], r["turn"]): r for r in rows if r["figure"] == "agent"}
    summaries = {r["run"]: r for r in rows if r["figure"] == "agent_summary"}
    assert set(summaries) == {"no_reuse", "reuse", "over_capacity"}
    assert all((run, t) in turns for run in summaries for t in (1, 2, 3))
    assert turns[("no_reuse", 3)]["cached_share_mean"] == 0 and turns[("no_reuse", 3)]["paths"] == {"root": 2}
    later = turns[("reuse", 3)]
    assert later["cached_share_min"] > 0.8 and set(later["paths"]) <= {"private_turn_closure", "private_endpoint"}
    assert turns[("over_capacity", 1)]["agents"] == 3 and "shared_stable_prefix" in turns[("over_capacity", 1)]["paths"]
    assert turns[("reuse", 2)]["prompt_tokens_p50"] > turns[("reuse", 1)]["prompt_tokens_p50"]


def test_stand_in_shapes_follow_the_fixture_sizes(tmp_path):
    shapes = agent.load_shapes(str(tmp_path))  # no fixtures there
    assert [s.kind for s in shapes] == ["claude-code", "codex"]
    assert len(shapes[0].system) >= agent._STANDIN_SIZES["claude-code"][0]
