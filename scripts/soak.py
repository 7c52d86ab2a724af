"""Soak a real ``ninfer-serve``: N clients for M minutes over every protocol, then check nothing leaked.

Each client loops over randomly picked requests (scripts/soak_clients.py): streams of the
four generation protocols read to their end, streams cut off mid-way, aggregate answers,
garbage bodies, bodies over --max-request-mib, bodies too slow for the read deadline and
slow-but-steady ones. With ``--sigterm-at F`` the server gets SIGTERM after that fraction
of the run and must drain cleanly (exit 0, no traceback, streams ended by their error
event, never truncated).

It prints the outcome counts, time to the first event of streams (p50, p99) and the
server's resident memory before and after, and fails (exit 1) on any 5xx, any truncated
or otherwise broken answer, any request stuck past ``--stuck-s``, and, after the load
stops, any capacity slot, engine request, KV page or state slot still held
(``GET /health/resources``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]
from server_harness import start_server, stop_server  # noqa: E402
from soak_clients import Bad, Run, aggregate, garbage, oversize, slow_body, stream  # noqa: E402

KEY = "soak-key"
MODEL = "soak-model"
#: behaviour -> weight
MIX = {"stream": 55, "cut": 10, "aggregate": 15, "garbage": 8, "oversize": 3, "slow": 4, "too_slow": 5}
SERVER_FLAGS = ("--profile", str(ROOT / "configs" / "demo.yaml"), "--api-key", KEY, "--model-id", MODEL,
                "--max-request-mib", "1", "--body-timeout-ms", "3000", "--drain-timeout-ms", "2000",
                "--log-stats-interval-ms", "30000")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--sigterm-at", type=float, default=None, metavar="F",
                        help="send SIGTERM after this fraction of the run (0..1) and check the drain")
    parser.add_argument("--stuck-s", type=float, default=180.0, help="a request running longer is stuck")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny:qwen3",
                        help="what to serve (MODEL_PATH), e.g. a ninfer-train directory with --spec mtp after --")
    parser.add_argument("server_flags", nargs="*", help="more ninfer-serve flags (after --)")
    return parser.parse_args()


async def client(run: Run, deadline: float, outcomes: collections.Counter, failures: list[str],
                 stuck_s: float) -> None:
    kinds, weights = list(MIX), list(MIX.values())
    async with httpx.AsyncClient(base_url=run.base, timeout=httpx.Timeout(stuck_s, connect=10)) as http:
        while time.monotonic() < deadline and not (run.stopping and run.exited()):
            kind = random.choices(kinds, weights)[0]
            work = {"stream": lambda: stream(run, http), "cut": lambda: stream(run, http, cut=True),
                    "aggregate": lambda: aggregate(run, http), "garbage": lambda: garbage(run, http),
                    "oversize": lambda: oversize(run, http), "slow": lambda: slow_body(run, too_slow=False),
                    "too_slow": lambda: slow_body(run, too_slow=True)}[kind]
            try:
                outcome = await asyncio.wait_for(work(), stuck_s)
                outcomes[outcome] += 1
                if outcome == "shed":  # as a client honouring Retry-After (1 s) would, roughly
                    await asyncio.sleep(random.uniform(0.2, 1.0))
            except asyncio.TimeoutError:
                failures.append(f"{kind}: stuck for more than {stuck_s:.0f} s")
            except Bad as exc:
                failures.append(f"{kind}: {exc}")
            except (httpx.TransportError, ConnectionError, OSError) as exc:
                if run.stopping:  # the server is draining or gone: connections end
                    outcomes["connection_closed_while_stopping"] += 1
                    await asyncio.sleep(0.2)
                else:
                    failures.append(f"{kind}: {type(exc).__name__}: {exc}")


async def soak(run: Run, args: argparse.Namespace, popen: Any) -> dict:
    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []
    started = time.monotonic()
    deadline = started + args.minutes * 60
    tasks = [asyncio.ensure_future(client(run, deadline, outcomes, failures, args.stuck_s))
             for _ in range(args.clients)]
    if args.sigterm_at is not None:
        await asyncio.sleep(args.minutes * 60 * args.sigterm_at)
        run.stopping = True
        popen.send_signal(signal.SIGTERM)
    await asyncio.gather(*tasks)
    return {"outcomes": outcomes, "failures": failures, "seconds": time.monotonic() - started}


def leaks(run: Run) -> list[str]:
    """What the idle server still holds (it may take a moment to unwind the last requests)."""
    found: list[str] = []
    for _ in range(50):
        held = httpx.get(f"{run.base}/health/resources", headers=run.headers, timeout=10).json()
        found = [f"{name} {held[name]['used']} still used" for name in ("requests", "kv_pages", "state_slots")
                 if held[name]["used"]]
        found += [f"{name} {held[name]}" for name in ("engine_running", "engine_waiting") if held[name]]
        if held["connections"] and held["connections"]["busy"] > 1:  # this request is one
            found.append(f"{held['connections']['busy'] - 1} connections still busy")
        if not found:
            return []
        time.sleep(0.2)
    return found


def host_kv_bytes(run: Run) -> Optional[float]:
    """The host KV tier's allocation from /metrics (RSS grows with it, by design), if served."""
    response = httpx.get(f"{run.base}/metrics", headers=run.headers, timeout=10)
    for line in response.text.splitlines() if response.status_code == 200 else ():
        if line.startswith("ninfer:host_kv_allocated_bytes"):
            return float(line.rsplit(" ", 1)[1])
    return None


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def main() -> int:
    args = parse_args()
    random.seed(args.seed)
    server = start_server(*SERVER_FLAGS, *args.server_flags, model=args.model)
    run = Run(base=str(server), key=KEY, model=MODEL, max_request_mib=1,
              exited=lambda: server.process.poll() is not None)
    process = psutil.Process(server.process.pid)
    rss_after, host_kv = None, None
    try:
        httpx.post(f"{server}/v1/chat/completions", headers=run.headers, timeout=60,
                   json={"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
        rss_before = process.memory_info().rss
        result = asyncio.run(soak(run, args, server.process))
        failures = list(result["failures"])
        if args.sigterm_at is None:
            rss_after = process.memory_info().rss
            failures += [f"leak: {what}" for what in leaks(run)]
            host_kv = host_kv_bytes(run)
        else:
            code = server.process.wait(60)
            if code != 0:
                failures.append(f"exit status {code} after SIGTERM")
        logs = server.logs()
    finally:
        stop_server(server)
    failures += [f"the server log holds {bad!r}" for bad in ("Traceback", "Exception in ASGI application")
                 if bad in logs]
    report(args, result, run.ttfb, rss_before, rss_after)
    if host_kv is not None:
        print(f"  of which the host KV tier (pinned pages of evicted prefixes): {host_kv / 2 ** 20:.0f} MiB")
    for line in failures[:30]:
        print("FAIL", line)
    if len(failures) > 30:
        print(f"... and {len(failures) - 30} more failures")
    print("PASS" if not failures else f"FAILED ({len(failures)} failures)")
    return 0 if not failures else 1


def report(args: argparse.Namespace, result: dict, ttfb: list[float], rss_before: int,
           rss_after: Optional[int]) -> None:
    outcomes, ttfb = result["outcomes"], sorted(ttfb)
    total = sum(outcomes.values())
    print(f"soak: {args.clients} clients, {result['seconds'] / 60:.1f} min, {total} requests"
          + (f", SIGTERM at {args.sigterm_at:.0%}" if args.sigterm_at is not None else ""))
    for name, n in outcomes.most_common():
        print(f"  {name:34} {n}")
    if ttfb:
        print(f"  first event of streams: p50 {percentile(ttfb, 50) * 1000:.0f} ms, "
              f"p99 {percentile(ttfb, 99) * 1000:.0f} ms ({len(ttfb)} streams)")
    after = f"{rss_after / 2 ** 20:.0f} MiB" if rss_after is not None else "(exited)"
    print(f"  server RSS: before {rss_before / 2 ** 20:.0f} MiB, after {after}")


if __name__ == "__main__":
    sys.exit(main())
