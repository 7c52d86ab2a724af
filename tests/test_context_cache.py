"""The context cache's bookkeeping: checkpoints and their limits, the reclaim order, the
cost presets file, and where a chat prompt's checkpoints go."""

from __future__ import annotations

import json

import pytest

from ninfer.engine.block_manager import BlockManager
from ninfer.engine.context_cache import CacheHints, ContextCache, DescriptorLimits
from ninfer.engine.context_cost import ContextCostError, ContextCosts, generic_costs, load_presets, parse_presets
from ninfer.engine.sequence import Sequence


def _cache(private=4, shared=4, anchors=2, spacing=8) -> ContextCache:
    return ContextCache(DescriptorLimits(private, shared, anchors), block_size=4, anchor_spacing=spacing)


def test_paths_name_the_deepest_checkpoint_the_hit_reached():
    cache = _cache()
    assert cache.admit(1, []) == "root"
    assert cache.admit(1, [11, 12]) == "compatible_prefix"  # pages, but no checkpoint among them
    cache.finish(1, [11, 12, 13, 14, 15], turn_closure=13)  # closure after 3 pages, endpoint after 5
    assert cache.admit(2, [11, 12, 13]) == "private_turn_closure"
    assert cache.admit(3, [11, 12, 13, 14]) == "private_turn_closure"  # past the closure, short of the endpoint
    assert cache.admit(4, [11, 12, 13, 14, 15]) == "private_endpoint"
    assert cache.admit(5, [11, 12, 13], replay=True) == "private_response_replay"
    assert cache.admit(6, [11, 12]) == "compatible_prefix"
    cache.share((11, 12))
    assert cache.admit(7, [11, 12]) == "shared_stable_prefix"
    cache.share((11, 12, 13))
    assert cache.admit(8, [11, 12, 13]) == "private_turn_closure"  # the conversation's own checkpoint wins


def test_a_continuation_replaces_the_one_it_continued_and_keeps_its_closures_as_anchors():
    cache = _cache(spacing=8)
    cache.finish(1, [1, 2, 3, 4], turn_closure=12)  # closure at 12 tokens
    assert cache.admit(2, [1, 2, 3]) == "private_turn_closure"
    cache.finish(2, [1, 2, 3, 5, 6, 7, 8, 9], turn_closure=28)  # closure at 28: the old one is 16 behind
    assert cache.num_continuations == 1 and cache.num_anchors == 1
    assert cache.stats.continuations_replaced == 1
    assert cache.admit(3, [1, 2, 3, 5]) == "private_long_anchor"
    assert not cache.retained(4)  # the old endpoint's page is on no kept chain any more
    assert cache.retained(3) and cache.retained(9)


def test_anchors_are_spaced_and_thinned_to_the_limit():
    cache = _cache(anchors=1, spacing=8)
    chain = list(range(1, 41))  # 40 pages = 160 tokens
    cache.finish(1, chain[:5], turn_closure=16)
    for seq, (pages, closure) in enumerate([(10, 36), (20, 76), (30, 116)], start=2):
        cache.admit(seq, chain[: (closure // 4) - 1])
        cache.finish(seq, chain[:pages], turn_closure=closure)
    assert cache.num_continuations == 1 and cache.num_anchors == 1
    assert cache.stats.anchors_dropped > 0
    cache2 = _cache(anchors=2, spacing=64)  # anchors closer than the spacing are not kept
    cache2.finish(1, chain[:5], turn_closure=16)
    cache2.admit(2, chain[:3])
    cache2.finish(2, chain[:10], turn_closure=36)  # only 20 tokens past the old closure
    assert cache2.num_anchors == 0


def test_private_limit_evicts_the_least_recently_used_conversation():
    cache = _cache(private=2)
    cache.finish(1, [1, 2], turn_closure=4)
    cache.finish(2, [3, 4], turn_closure=4)
    cache.admit(3, [1])  # conversation 1 is used again
    cache.finish(4, [5, 6], turn_closure=4)  # a third: conversation 2 goes
    assert cache.num_continuations == 2 and cache.stats.continuations_evicted == 1
    assert cache.admit(5, [3]) == "compatible_prefix" and not cache.retained(4)
    assert cache.admit(6, [5]) == "private_turn_closure"
    assert _cache(private=0).admit(1, [1]) == "compatible_prefix"


def test_shared_limit_and_zero_limits():
    cache = _cache(shared=1)
    cache.share((1, 2))
    cache.share((7, 8))
    assert cache.num_shared == 1 and cache.stats.shared_evicted == 1
    assert cache.admit(1, [1, 2]) == "compatible_prefix" and cache.admit(2, [7, 8]) == "shared_stable_prefix"
    none = _cache(shared=0)
    none.share((1, 2))
    assert none.num_shared == 0 and not none.retained(1)


def test_automatic_candidates_give_way_to_marked_prefixes():
    """OpenAI's implicit candidates fill the shared list on every request; over the limit they
    leave before a client's marked system prompt, however recent they are."""
    cache = _cache(shared=2)
    cache.share((1, 2))  # marked (Anthropic cache_control)
    for chain in ((3, 4), (5, 6), (7, 8)):
        cache.share(chain, implicit=True)
    assert cache.admit(1, [1, 2]) == "shared_stable_prefix" and cache.admit(2, [7, 8]) == "shared_stable_prefix"
    assert cache.admit(3, [5, 6]) == "compatible_prefix"
    cache.share((7, 8))  # a client's mark on an automatic candidate makes it a marked one
    cache.share((9, 10), implicit=True)
    assert cache.admit(4, [7, 8]) == "shared_stable_prefix" and cache.admit(5, [1, 2]) == "shared_stable_prefix"


def test_forgetting_a_page_drops_its_checkpoints_and_shrinks_the_retained_chain():
    cache = _cache()
    cache.finish(1, [1, 2, 3, 4], turn_closure=8)
    cache.forget(4)  # the endpoint's page is gone: the closure stands
    assert cache.admit(2, [1, 2, 3]) == "private_turn_closure" and not cache.retained(4) and cache.retained(2)
    cache.forget(2)
    assert cache.num_continuations == 0 and not cache.retained(1)


# -- the reclaim order, through the block manager -----------------------------------------


def _seq(i: int, tokens: list[int], hints: CacheHints = CacheHints(), max_tokens: int = 1) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    max_tokens=max_tokens, cache_hints=hints)


def _run(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.free(seq)


def test_pages_no_checkpoint_retains_are_reclaimed_first():
    # 6 pages of 4 tokens; no private continuations, so only the marked prefix is retained
    bm = BlockManager(6, 4, limits=DescriptorLimits(private_continuations=0, shared_prefixes=4))
    a = list(range(100, 112))
    _run(bm, _seq(0, a, CacheHints(shared=(8,))))  # freed first; its first two pages are marked
    _run(bm, _seq(1, list(range(200, 212))))  # freed later, retained by nothing
    assert bm.num_retained_blocks == 2
    _run(bm, _seq(2, list(range(300, 315)), max_tokens=1))  # needs 4 fresh pages: LRU would take a's first
    again = _seq(3, a + [1])
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.reuse_path == "shared_stable_prefix"


def test_retained_chains_shrink_from_their_tail_cheapest_first():
    costs = ContextCosts(prefill_ns_per_token=1.0, depth_ns_per_token_per_ktoken=1000.0, host_gbps=1.0)
    bm = BlockManager(12, 4, limits=DescriptorLimits(private_continuations=4), costs=costs)
    deep, short = list(range(100, 125)), list(range(200, 209))
    _run(bm, _seq(0, deep))  # 6 pages published, a continuation retains them
    _run(bm, _seq(1, short))  # 2 pages
    assert bm.num_retained_blocks == 8
    _run(bm, _seq(2, list(range(300, 317)), max_tokens=1))  # 4 clean pages and one reclaimed: the cheapest leaf
    probe = _seq(3, deep + [1])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 24  # the deep chain is whole
    bm.free(probe)
    other = _seq(4, short + [1])
    bm.allocate(other)
    assert other.num_cached_tokens == 4  # the short one lost its tail page, not its head


# -- cost presets --------------------------------------------------------------------------


def test_presets_file_resolves_over_the_generic_costs(tmp_path):
    path = tmp_path / "costs.yaml"
    path.write_text("version: 1\ntransfer: {host_gbps: 12.5}\nprefill:\n  - model: qwen3_5\n    device: H200\n"
                    "    ns_per_token: 90000\n    ns_per_token_per_ktoken: 150\n  - model: qwen3\n    ns_per_token: 7\n")
    presets = load_presets(str(path))
    generic = generic_costs(1_000_000, 256, "cpu")
    h200 = presets.resolve(generic, ("qwen3_5",), "NVIDIA H200")
    assert (h200.prefill_ns_per_token, h200.host_gbps) == (90000, 12.5) and "prefill[0]" in h200.source
    cpu = presets.resolve(generic, ("qwen3",), "cpu")
    assert cpu.prefill_ns_per_token == 7 and "prefill[1]" in cpu.source
    none = load_presets(_write(tmp_path, "p.json", {"prefill": [{"model": "llama", "ns_per_token": 1}]}))
    assert none.resolve(generic, ("qwen3",), "cpu").source.startswith("generic defaults")
    assert generic.spill_pays(0, 16, 1) and not generic.spill_pays(0, 1, 10**12)


def _write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("data, key", [
    ({"transfer": {"host_gbps": -1}}, "transfer.host_gbps"),
    ({"transfer": {"gbps": 3}}, "transfer.gbps"),
    ({"prefill": [{"model": "x", "ns_per_token": "fast"}]}, "prefill[0].ns_per_token"),
    ({"prefill": [{"ns_per_token": 3}]}, "prefill[0].model"),
    ({"prefill": {"model": "x"}}, "prefill"),
    ({"colour": 1}, "colour"),
    ({"version": 2, "transfer": {"host_gbps": 1}}, "version"),
    ({}, "sets nothing"),
])
def test_a_malformed_presets_file_names_the_key(tmp_path, data, key):
    with pytest.raises(ContextCostError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_presets(_write(tmp_path, "bad.json", data))


def test_presets_must_parse(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [\n")
    with pytest.raises(ContextCostError, match="not valid YAML"):
        load_presets(str(bad))
    with pytest.raises(ContextCostError, match="cannot be read"):
        load_presets(str(tmp_path / "missing.yaml"))
    with pytest.raises(ContextCostError, match="expected a mapping"):
        parse_presets([1], "x")


def test_profile_check_refuses_a_bad_presets_file(tmp_path):
    from ninfer.profile import load_profile
    from ninfer.profile.resolve import context_cost_errors

    path = _write(tmp_path, "bad.json", {"transfer": {"host_gbps": 0}})
    profile = load_profile(None, model="tiny:qwen3", overrides={"context_cost_presets": path})
    (error,) = context_cost_errors(profile)
    assert error.startswith("engine.context_cost_presets: ") and "transfer.host_gbps" in error


# -- where a chat prompt's checkpoints go ---------------------------------------------------


def test_chat_hints_find_the_turn_closure_and_marked_message_ends():
    from ninfer.frontend.cache_hints import chat_cache_hints
    from ninfer.frontend.chat_messages import ChatTurn
    from ninfer.frontend.pipeline_request import ChatPrompt, TextPrompt

    class Vocab:
        def token_to_id(self, token):
            return {"<|im_start|>": 1, "<|im_end|>": 2}.get(token)

    #        system      user          tool a+b (one message)   open assistant
    ids = [1, 5, 5, 2, 9, 1, 6, 6, 2, 9, 1, 7, 7, 7, 2, 9, 1, 8]
    turns = [ChatTurn("system", "s"), ChatTurn("user", "u"), ChatTurn("tool", "a"), ChatTurn("tool", "b")]
    prompt = ChatPrompt(turns, cache_breakpoints=(1, 2, 3, 4))
    hints = chat_cache_hints(prompt, ids, Vocab())
    assert hints.turn_closure == 16
    assert hints.shared == (4, 9, 15)  # after 1, 2 and 4 turns; "after 3" splits the tool message
    tools_only = ChatPrompt(turns[1:], tools=({"type": "function"},), cache_breakpoints=(0,))
    assert chat_cache_hints(tools_only, ids, Vocab()).shared == (4,)  # tools render a system message
    # a developer turn renders as the system message the tools join (Responses' instructions)
    developer = ChatPrompt([ChatTurn("developer", "s"), *turns[1:]], tools=({"type": "function"},),
                           cache_breakpoints=(1, 2))
    assert chat_cache_hints(developer, ids, Vocab()).shared == (4, 9)
    assert chat_cache_hints(TextPrompt("x"), ids, Vocab(), replay=True) == CacheHints(replay=True)
    automatic = chat_cache_hints(ChatPrompt(turns[:2], implicit_breakpoint=2), ids, Vocab())
    assert automatic.shared == () and automatic.implicit_shared == (9,)
