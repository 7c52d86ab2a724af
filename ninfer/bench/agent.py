"""``ninfer-bench --workload agent``: multi-turn tool-using conversations, as coding agents send them.

Each agent holds one conversation shaped like the Claude Code and Codex requests in
``shared/fixtures`` (agents alternate between the two): a long system prompt with tool
definitions that every agent of that kind shares, a task, then per turn the assistant's
tool call and the tool's result appended to the history. The model's own reply is not
sent back (clients re-render it, which rarely reproduces the generated tokens); the
synthetic tool call stands in for it. Agents run closed-loop: an agent sends its next
turn as soon as its previous one finishes, ``--agents`` of them at once.

Three runs share one loaded engine, in this order: without reuse (the requests neither
look up nor publish cached pages, as under ``--no-prefix-reuse``), with reuse, and with
reuse but four times as many conversations (``--agent-over-capacity``), meant to hold
more than the KV pool does: each summary gives ``conversation_tokens``, the conversations'
final prompts summed without their shared system prompts, beside the pool's size. Each prints
one JSON line per turn: prompt tokens (median), the cached share of the prompt (mean and
worst), TTFT (median) and the reuse paths seen; then one summary line per run against
the goal (from turn 2 on at least 95% of every prompt served from cache, TTFT at the
last turn within 1.5x of turn 2). Without the fixtures (a checkout without ``shared/``)
text of the same sizes stands in.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

FIXTURES = ("claude-code-2.1.197-messages-request.json", "codex-0.171.0-responses-request.json")
#: where the fixtures are looked for: ``shared/fixtures`` beside the checkout, then /work/shared
_FIXTURE_DIRS = (Path(__file__).resolve().parents[2].parent / "shared" / "fixtures", Path("/work/shared/fixtures"))
#: the fixtures' sizes in characters (system text, tool JSON, task), for the stand-in text
_STANDIN_SIZES = {"claude-code": (26_500, 80_500, 6_800), "codex": (19_800, 18_600, 700)}
_WORDS = ("the file read edit command patch test build error output line function module value path "
          "check result update config search return list index token cache state run step").split()


@dataclass
class AgentShape:
    """What every agent of one kind starts with."""

    kind: str
    system: str
    tools: list[dict[str, Any]]
    task: str


def _filler(chars: int, seed: int) -> str:
    words, i, length = [], seed, 0
    while length < chars:
        words.append(_WORDS[(i * 7 + len(words) * 13) % len(_WORDS)])
        length += len(words[-1]) + 1
        i += 1
    return " ".join(words)


def _function(tool: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A fixture tool in the chat template's function shape (None: not a function tool)."""
    if "input_schema" in tool:  # Anthropic
        return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                 "parameters": tool["input_schema"]}}
    if tool.get("type") == "function":  # Responses
        return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                 "parameters": tool.get("parameters") or {"type": "object"}}}
    return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") in ("text", "input_text"))


def find_fixtures(fixture_dir: Optional[str] = None) -> Optional[Path]:
    """The folder holding both fixtures (``fixture_dir``, else the usual places), or None."""
    dirs = [Path(fixture_dir)] if fixture_dir else list(_FIXTURE_DIRS)
    return next((d for d in dirs if all((d / f).exists() for f in FIXTURES)), None)


def load_shapes(fixture_dir: Optional[str] = None) -> list[AgentShape]:
    """The two agent kinds, from the fixtures when they can be found, else stand-in text."""
    found = find_fixtures(fixture_dir)
    if found is None:
        return [AgentShape(kind, _filler(s, 1), [{"type": "function", "function": {
                    "name": f"tool_{i}", "description": _filler(t // 12, i), "parameters": {"type": "object"}}}
                    for i in range(12)], _filler(k, 2)) for kind, (s, t, k) in _STANDIN_SIZES.items()]
    claude = json.loads((found / FIXTURES[0]).read_text())["body"]
    system = "\n".join(b["text"] for b in claude["system"][1:])  # the first block is the billing line
    claude_tools = [f for f in map(_function, claude["tools"]) if f is not None]
    claude_task = "\n".join(_text_of(m["content"]) for m in claude["messages"] if m["role"] == "user")
    codex = json.loads((found / FIXTURES[1]).read_text())["body"]
    items = [i for i in codex["input"] if i.get("type") == "message"]
    codex_system = "\n".join(_text_of(i["content"]) for i in items if i["role"] in ("developer", "system"))
    codex_task = "\n".join(_text_of(i["content"]) for i in items if i["role"] == "user")
    codex_tools = [f for f in map(_function, codex["tools"]) if f is not None]
    return [AgentShape("claude-code", system, claude_tools, claude_task),
            AgentShape("codex", codex_system, codex_tools, codex_task)]


def fit_prefix(shape: AgentShape, tokenizer, max_tokens: int) -> AgentShape:
    """``shape`` cut down so its system text and tool JSON take about ``max_tokens`` (0: whole)."""
    if max_tokens <= 0:
        return shape
    tool_tokens = [len(tokenizer.encode(json.dumps(t))) for t in shape.tools]
    tools, used = [], 0
    for tool, n in zip(shape.tools, tool_tokens):
        if used + n > max_tokens // 2:
            break
        tools.append(tool)
        used += n
    system_ids = tokenizer.encode(shape.system)
    system = tokenizer.decode(system_ids[: max(max_tokens - used, 64)])
    return AgentShape(shape.kind, system, tools, shape.task)


def conversation(shape: AgentShape, agent: int, turns_done: int, result_words: int):
    """The ChatTurns of one agent's request after ``turns_done`` tool round trips."""
    from ninfer.frontend.chat_messages import ChatTurn, ToolCall

    tool_names = [t["function"]["name"] for t in shape.tools] or ["shell"]
    turns = [ChatTurn("system", shape.system), ChatTurn("user", f"[agent {agent}] {shape.task}")]
    for k in range(turns_done):
        call_id = f"call_{agent}_{k}"
        name = tool_names[(agent + k) % len(tool_names)]
        turns.append(ChatTurn("assistant", "", tool_calls=[ToolCall(call_id, name, {"step": k, "agent": agent})]))
        turns.append(ChatTurn("tool", f"[{agent}.{k}] " + _filler(result_words * 6, agent * 31 + k),
                              tool_call_id=call_id))
    return turns


@dataclass
class TurnRecord:
    agent: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    path: str


def run_agents(llm, shapes: list[AgentShape], agents: int, turns: int, result_words: int, output_tokens: int,
               reuse: bool, tag: str) -> list[TurnRecord]:
    """Closed-loop agents on ``llm``'s engine; every agent's turns, in completion order."""
    from ninfer.engine.request import EngineRequest
    from ninfer.frontend.pipeline_request import CachePolicy, ChatPrompt, GenerateRequest
    from ninfer.bench.ninfer_runs import GREEDY
    from ninfer.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, **GREEDY)
    cache = CachePolicy(lookup=reuse, commit=reuse)
    done_turns = [0] * agents
    sent: dict[str, tuple[int, float]] = {}
    first: dict[str, tuple[float, int, str]] = {}
    records: list[TurnRecord] = []

    def submit(agent: int) -> None:
        shape = shapes[agent % len(shapes)]
        turns_list = conversation(shape, agent, done_turns[agent], result_words)
        # the client marks its system prompt and its last message, as Claude Code does
        prompt = ChatPrompt(turns_list, tuple(shape.tools), cache_breakpoints=(1, len(turns_list)))
        rid = f"{tag}-{agent}-{done_turns[agent]}"
        req: EngineRequest = llm.pipeline.plan(GenerateRequest([prompt], params, cache=cache), rid).requests[0]
        sent[req.request_id] = (agent, time.perf_counter())
        engine.add_request(req)

    for agent in range(agents):
        submit(agent)
    while engine.has_unfinished():
        for event in engine.step():
            rid = event.request_id
            if event.token_ids and rid not in first:
                first[rid] = (time.perf_counter(), event.num_cached_tokens, event.timings.reuse_path or "root")
            if not event.finished:
                continue
            agent, began = sent.pop(rid)
            at, cached, path = first.pop(rid, (time.perf_counter(), event.num_cached_tokens, "root"))
            done_turns[agent] += 1
            records.append(TurnRecord(agent, done_turns[agent], event.num_prompt_tokens, cached, at - began, path))
            if done_turns[agent] < turns:
                submit(agent)
    return records


def turn_rows(records: list[TurnRecord], run: str) -> list[dict[str, Any]]:
    """One row per turn over every agent."""
    rows = []
    for turn in sorted({r.turn for r in records}):
        at = [r for r in records if r.turn == turn]
        shares = [r.cached_tokens / r.prompt_tokens for r in at]
        rows.append({"figure": "agent", "run": run, "turn": turn, "agents": len(at),
                     "prompt_tokens_p50": statistics.median(r.prompt_tokens for r in at),
                     "cached_share_mean": round(statistics.fmean(shares), 4), "cached_share_min": round(min(shares), 4),
                     "ttft_ms_p50": round(1000 * statistics.median(r.ttft for r in at), 2),
                     "paths": dict(Counter(r.path for r in at))})
    return rows


def summary(rows: list[dict[str, Any]], run: str, seconds: float) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] >= 2]
    second = next((r for r in rows if r["turn"] == 2), None)
    last = rows[-1] if rows else None
    ratio = last["ttft_ms_p50"] / second["ttft_ms_p50"] if second and last and second["ttft_ms_p50"] else None
    return {"figure": "agent_summary", "run": run, "seconds": round(seconds, 2),
            "cached_share_min_from_turn_2": min((r["cached_share_min"] for r in later), default=None),
            "goal_cached_share_95": all(r["cached_share_min"] >= 0.95 for r in later) if later else None,
            "ttft_last_over_turn_2": round(ratio, 3) if ratio is not None else None,
            "goal_ttft_within_1_5x": ratio <= 1.5 if ratio is not None else None}


def agent_workload(args, emit: Callable[[dict], None]) -> None:
    """Load the model once, then the three runs (module docstring)."""
    from ninfer import LLM
    from ninfer.engine.builder import resolve_device, resolve_dtype
    from ninfer.model.sources import resolve_source
    from ninfer.plugins import load_registry

    device_arg = int(args.device) if args.device.isdigit() else args.device
    device = resolve_device(device_arg)
    dtype = resolve_dtype(args.dtype, device)
    path, weights = resolve_source(args.model, load_registry(), dtype, device, args.seed)
    a = args.agents
    # the longest conversation: the prefix, the task, every round trip, the output, with room to spare
    max_context = args.agent_prefix_tokens + 4096 + args.turns * (args.agent_result_words * 3 + 96) + args.agent_output_tokens
    max_context = -(-max_context // 1024) * 1024
    llm = LLM(str(path), device=device_arg, dtype=args.dtype, weights=weights, kv_dtype=args.kv_dtype,
              max_num_seqs=a, max_context=max_context, kv_capacity=a * max_context * 5 // 4,
              prefill_chunk=args.prefill_chunk, cuda_graph=not args.no_cuda_graph,
              host_kv_mib=args.agent_host_kv_mib, device_state_slots=4 * a,
              max_private_continuations=2 * a)
    tokenizer = llm.get_tokenizer()
    shapes = [fit_prefix(s, tokenizer, args.agent_prefix_tokens) for s in load_shapes(args.agent_fixtures)]
    common = {"model": args.model, "device": str(device), "agents": a, "turns": args.turns,
              "kv_capacity_tokens": llm.engine.kv_capacity_tokens,
              "fixtures": "found" if find_fixtures(args.agent_fixtures) else "stand-in"}
    shared = {s.kind: len(tokenizer.encode(s.system)) for s in shapes}  # each kind's system prompt
    runs = [("no_reuse", a, False), ("reuse", a, True), ("over_capacity", args.agent_over_capacity or 4 * a, True)]
    for name, agents, reuse in runs:
        began = time.perf_counter()
        records = run_agents(llm, shapes, agents, args.turns, args.agent_result_words, args.agent_output_tokens,
                             reuse, name)
        rows = turn_rows(records, name)
        for row in rows:
            emit({**row, **common, "agents": agents})
        last = {r.agent: r.prompt_tokens for r in records}  # each conversation's final prompt
        private = sum(n - shared[shapes[i % len(shapes)].kind] for i, n in last.items())
        emit({**summary(rows, name, time.perf_counter() - began), **common, "agents": agents,
              "conversation_tokens": private + sum(shared.values())})
