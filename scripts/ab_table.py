"""The table of a `gpu_session.sh ab` call: one row per variant and concurrency, read from
the stage's bench.jsonl (each `{"ab": ...}` line names the variant of the decode figures
after it). Printed at the end of the stage, so a call's output tail holds the comparison.

    python3 scripts/ab_table.py "$OUT/bench.jsonl"
"""

from __future__ import annotations

import json
import sys


def rows(lines: list[str]) -> list[tuple[str, int, float, float, float | None]]:
    """(variant, concurrency, tok/s, step ms, graph replay ms) per decode figure; a
    variant is named with its model when the figures cover more than one."""
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a bench's stray output
    models = {r["model"] for r in records if "ab" in r and "model" in r}
    named, out = "(before any variant)", []
    for record in records:
        if "ab" in record:
            named = record["ab"] + (f" ({record['model']})" if len(models) > 1 else "")
        elif record.get("figure") == "decode" and "decode_tok_s" in record:
            out.append((named, record["concurrency"], record["decode_tok_s"], record["step_ms"],
                        record.get("graph_replay_ms")))
    return out


def main(path: str) -> None:
    with open(path) as f:
        table = rows(f.read().splitlines())
    width = max((len(r[0]) for r in table), default=7)
    print(f"{'variant':{width}}  c  tok/s    step ms  replay ms")
    for named, c, tok_s, step, replay in table:
        replay_text = f"{replay:.4f}" if replay is not None else "-"
        print(f"{named:{width}}  {c}  {tok_s:7.1f}  {step:.4f}   {replay_text}")


if __name__ == "__main__":
    main(sys.argv[1])
