"""ninfer-bench: the GPU suite preset and one small CPU run of each figure."""

from __future__ import annotations

import json

from ninfer.cli import bench


def test_gpu_suite_presets_the_issue_figures_and_flags_still_win():
    args = bench.parse_args(["--suite", "gpu", "--concurrency", "1,8"])
    assert args.model == "random:qwen3-8b" and args.offline_model == "random:qwen3-0.6b"
    assert args.concurrency == "1,8"  # explicit flag kept
    assert args.hf_compiled == "1,8" and args.num_requests == 256 and args.input_len == (100, 1024)
    assert set(args.only.split(",")) == {"bandwidth", "decode", "prefill", "offline"}


def test_cpu_run_prints_one_json_line_per_figure(capsys):
    code = bench.main(["tiny:qwen3", "--device", "cpu", "--only", "decode,prefill,offline", "--concurrency", "2",
                       "--decode-prompt-len", "16", "--decode-output-len", "8", "--prefill-lens", "32",
                       "--num-requests", "3", "--input-len", "8,16", "--output-len", "4,8", "--no-transformers"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    figures = [(r["figure"], r["engine"]) for r in lines]
    assert figures == [("decode", "ninfer"), ("prefill", "ninfer"), ("offline_throughput", "ninfer")]
    decode = lines[0]
    assert decode["concurrency"] == 2 and decode["decode_tokens"] == 2 * 7 and decode["decode_tok_s"] > 0
    assert lines[1]["prompt_tokens"] == 32 and lines[1]["prefill_tok_s"] > 0
    assert lines[2]["output_tokens"] >= 3 * 4
