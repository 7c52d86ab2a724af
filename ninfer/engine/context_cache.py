"""Checkpoints: which cached prefixes are worth keeping, and what a hit reused.

The prefix cache can reuse any published page, but not every page is worth the same.
A *checkpoint* names exactly one prefix (the prefix-cache node id of its last page,
never reused) and says why it is kept:

- a *private continuation* is what a finished request leaves for the next turn of its
  conversation: its *endpoint* (prompt and output, as far as whole pages were computed)
  and its *turn closure* (the prompt up to where the generation prologue starts, which
  the next turn renders again even when it renders the reply differently);
- *long anchors* are earlier turn closures of the same conversation kept inside a long
  continuation, so a request that changes something deep in the history falls back to
  the nearest anchor before the change instead of to the start;
- a *shared stable prefix* is a boundary a client marked (Anthropic ``cache_control``,
  OpenAI's implicit prompt-cache candidate): a system prompt and tools that several
  conversations start with.

A conversation needs no client key: a request whose deepest checkpoint within its hit is
a private one continues that continuation, and its own continuation replaces it
when it finishes; any other request starts a new one. Three limits cap the bookkeeping
(least recently used first out): private continuations in all, shared prefixes engine
wide, and anchors per continuation. Pages on a retained chain are reclaimed only after
every page no checkpoint retains (:mod:`ninfer.engine.reclaim`), and state snapshots at
a checkpoint outlive the others (:mod:`ninfer.engine.state_cache`).

The *reuse path* of a request is the kind of the deepest checkpoint at or before the
end of its hit: ``root`` when nothing was reused, ``compatible_prefix`` for whole pages
that no checkpoint marks (dense models can resume at any page). docs/context-cache.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

#: every value ``prefix_reuse_path`` takes
PATHS = ("root", "compatible_prefix", "private_endpoint", "private_turn_closure", "private_response_replay",
         "private_long_anchor", "shared_stable_prefix")
#: a hit on several checkpoints at one node is labelled by the first kind here
_PREFERENCE = ("endpoint", "turn_closure", "long_anchor", "shared")
_PATH_OF = {"endpoint": "private_endpoint", "turn_closure": "private_turn_closure",
            "long_anchor": "private_long_anchor", "shared": "shared_stable_prefix"}
#: long anchors sit at least this many tokens apart (and from the checkpoints after them)
ANCHOR_SPACING = 1024


@dataclass(frozen=True)
class CacheHints:
    """What the front door knows about a prompt's structure (token positions)."""

    #: where the generation prologue starts (the end of the last complete message)
    turn_closure: Optional[int] = None
    #: shared stable-prefix boundaries the client marked
    shared: tuple[int, ...] = ()
    #: automatic shared-prefix candidates (OpenAI's implicit prompt caching): kept like
    #: marked ones, but the first to give way when the shared-prefix limit is reached
    implicit_shared: tuple[int, ...] = ()
    #: the prompt replays a stored response (Responses' previous_response_id)
    replay: bool = False


@dataclass(frozen=True)
class DescriptorLimits:
    private_continuations: int = 2
    shared_prefixes: int = 4
    anchors_per_continuation: int = 2


@dataclass(eq=False)
class Checkpoint:
    kind: str  # endpoint, turn_closure, long_anchor or shared
    node: int
    tokens: int
    chain: tuple[int, ...]  # node ids of every page up to and including ``node``
    owner: Optional[int] = None  # the continuation (None: a shared prefix)
    implicit: bool = False  # a shared prefix no client marked (an automatic candidate)


@dataclass
class Continuation:
    cid: int
    checkpoints: list[Checkpoint] = field(default_factory=list)
    covered: tuple[int, ...] = ()  # the chain this continuation retains (its deepest checkpoint's)


@dataclass
class CheckpointStats:
    continuations_created: int = 0
    continuations_replaced: int = 0  # by their conversation's next turn
    continuations_evicted: int = 0  # by the private-continuation limit
    shared_created: int = 0
    shared_evicted: int = 0  # by the shared-prefix limit
    anchors_kept: int = 0
    anchors_dropped: int = 0  # by the per-continuation limit
    forgotten: int = 0  # checkpoints whose page left the cache


class ContextCache:
    """The checkpoints and the coverage counts of the pages they retain.

    ``on_retained(node, retained)`` hears every page whose retention changes, so the
    block manager can move it between its reclaim classes; ``on_checkpoint(node,
    present)`` every node that gains its first checkpoint or loses its last (the state
    snapshots there are kept longer).
    """

    def __init__(self, limits: DescriptorLimits, block_size: int, anchor_spacing: int = ANCHOR_SPACING,
                 on_retained: Optional[Callable[[int, bool], None]] = None,
                 on_checkpoint: Optional[Callable[[int, bool], None]] = None) -> None:
        self.limits = limits
        self.block_size = block_size
        self.anchor_spacing = anchor_spacing
        self.on_retained = on_retained or (lambda node, retained: None)
        self.on_checkpoint = on_checkpoint or (lambda node, present: None)
        self._at: dict[int, list[Checkpoint]] = {}
        self._cover: dict[int, int] = {}
        self._continuations: OrderedDict[int, Continuation] = OrderedDict()  # least recently used first
        self._shared: OrderedDict[int, Checkpoint] = OrderedDict()  # node -> checkpoint, least recent first
        self._continues: dict[int, int] = {}  # seq id -> the continuation its hit landed on
        self._next_cid = 1
        self.stats = CheckpointStats()

    # -- queries ----------------------------------------------------------------------
    def retained(self, node: int) -> bool:
        return self._cover.get(node, 0) > 0

    def is_checkpoint(self, node: int) -> bool:
        return node in self._at

    @property
    def num_continuations(self) -> int:
        return len(self._continuations)

    @property
    def num_shared(self) -> int:
        return len(self._shared)

    @property
    def num_anchors(self) -> int:
        return sum(1 for c in self._continuations.values() for cp in c.checkpoints if cp.kind == "long_anchor")

    # -- admission ----------------------------------------------------------------------
    def admit(self, seq_id: int, hit_nodes: list[int], replay: bool = False) -> str:
        """The reuse path of a request whose hit is ``hit_nodes`` (its pages, in order);
        remembers the continuation it continues, and marks what it used as recent."""
        if not hit_nodes:
            return "root"
        for node in reversed(hit_nodes):
            found = self._at.get(node)
            if not found:
                continue
            best = min(found, key=lambda cp: _PREFERENCE.index(cp.kind))
            if best.owner is not None:
                self._continues[seq_id] = best.owner
                self._continuations.move_to_end(best.owner)
                return "private_response_replay" if replay else _PATH_OF[best.kind]
            self._shared.move_to_end(node)
            return _PATH_OF[best.kind]
        return "compatible_prefix"

    # -- shared prefixes -------------------------------------------------------------
    def share(self, chain: tuple[int, ...], implicit: bool = False) -> None:
        """Keep the prefix ending at ``chain[-1]`` as a shared stable prefix (or mark it recent).
        Over the limit, the least recent automatic candidate leaves first, else the least
        recent prefix: every OpenAI request brings a candidate, and they must not push out
        the system prompts clients marked on purpose."""
        node = chain[-1]
        if node in self._shared:
            self._shared.move_to_end(node)
            self._shared[node].implicit &= implicit  # a client's mark makes it explicit
            return
        if self.limits.shared_prefixes < 1:
            return
        cp = Checkpoint("shared", node, len(chain) * self.block_size, chain, implicit=implicit)
        self._shared[node] = cp
        self._index(cp)
        self._cover_chain(chain, +1)
        self.stats.shared_created += 1
        while len(self._shared) > self.limits.shared_prefixes:
            victim = next((n for n, c in self._shared.items() if c.implicit), next(iter(self._shared)))
            old = self._shared.pop(victim)
            self._unindex(old)
            self._cover_chain(old.chain, -1)
            self.stats.shared_evicted += 1

    # -- private continuations -------------------------------------------------------
    def finish(self, seq_id: int, chain: list[int], turn_closure: Optional[int]) -> None:
        """A request ended with its published pages ``chain``: leave its continuation,
        replacing the one it continued (whose turn closures become its long anchors)."""
        previous_id = self._continues.pop(seq_id, None)
        if not chain or self.limits.private_continuations < 1:
            return
        previous = self._continuations.pop(previous_id, None) if previous_id is not None else None
        cont = Continuation(self._next_cid)
        self._next_cid += 1
        bs = self.block_size
        cont.checkpoints.append(Checkpoint("endpoint", chain[-1], len(chain) * bs, tuple(chain), cont.cid))
        closure_pages = (turn_closure or 0) // bs
        if 0 < closure_pages < len(chain):
            cont.checkpoints.append(Checkpoint("turn_closure", chain[closure_pages - 1], closure_pages * bs,
                                               tuple(chain[:closure_pages]), cont.cid))
        if previous is not None:
            cont.checkpoints += self._anchors(previous, chain, min(cp.tokens for cp in cont.checkpoints), cont.cid)
        for cp in cont.checkpoints:
            self._index(cp)
        cont.covered = tuple(chain)
        self._cover_chain(cont.covered, +1)  # before the previous one lets go: shared pages stay retained
        self._continuations[cont.cid] = cont
        self.stats.continuations_created += 1
        if previous is not None:
            self._release(previous)
            self.stats.continuations_replaced += 1
        while len(self._continuations) > self.limits.private_continuations:
            _, old = self._continuations.popitem(last=False)
            self._release(old)
            self.stats.continuations_evicted += 1

    def _anchors(self, previous: Continuation, chain: list[int], below: int, cid: int) -> list[Checkpoint]:
        """The previous continuation's turn closures and anchors that the new chain still
        contains, spaced apart and thinned to the per-continuation limit."""
        limit = self.limits.anchors_per_continuation
        if limit < 1:
            return []
        on_chain = set(chain)
        candidates = sorted((cp for cp in previous.checkpoints
                             if cp.kind in ("turn_closure", "long_anchor") and cp.node in on_chain),
                            key=lambda cp: cp.tokens)
        kept: list[Checkpoint] = []
        ceiling = below
        for cp in reversed(candidates):  # deepest first, each far enough from the one after it
            if ceiling - cp.tokens >= self.anchor_spacing:
                kept.append(cp)
                ceiling = cp.tokens
        kept.reverse()
        while len(kept) > limit:  # drop the one whose removal leaves the smallest gap
            bounds = [0, *(cp.tokens for cp in kept), below]
            i = min(range(len(kept)), key=lambda k: bounds[k + 2] - bounds[k])
            del kept[i]
            self.stats.anchors_dropped += 1
        self.stats.anchors_kept += len(kept)
        return [Checkpoint("long_anchor", cp.node, cp.tokens, cp.chain, cid) for cp in kept]

    def _release(self, cont: Continuation) -> None:
        for cp in cont.checkpoints:
            self._unindex(cp)
        self._cover_chain(cont.covered, -1)

    # -- the prefix cache forgot a page ----------------------------------------------
    def forget(self, node: int) -> None:
        """The page ``node`` left the cache for good: checkpoints ending there go too."""
        for cp in list(self._at.get(node, ())):
            self.stats.forgotten += 1
            self._unindex(cp)
            if cp.owner is None:
                del self._shared[node]
                self._cover_chain(cp.chain, -1)
                continue
            cont = self._continuations.get(cp.owner)
            if cont is None:
                continue
            cont.checkpoints.remove(cp)
            deepest = max(cont.checkpoints, key=lambda c: c.tokens, default=None)
            covered = deepest.chain if deepest is not None else ()
            self._cover_chain(covered, +1)
            self._cover_chain(cont.covered, -1)
            cont.covered = covered
            if deepest is None:
                del self._continuations[cont.cid]

    # -- bookkeeping -----------------------------------------------------------------
    def _index(self, cp: Checkpoint) -> None:
        found = self._at.setdefault(cp.node, [])
        found.append(cp)
        if len(found) == 1:
            self.on_checkpoint(cp.node, True)

    def _unindex(self, cp: Checkpoint) -> None:
        found = self._at.get(cp.node)
        if found is not None and cp in found:
            found.remove(cp)
            if not found:
                del self._at[cp.node]
                self.on_checkpoint(cp.node, False)

    def _cover_chain(self, chain: Iterable[int], delta: int) -> None:
        cover = self._cover
        for node in chain:
            count = cover.get(node, 0) + delta
            if count > 0:
                cover[node] = count
                if count == delta:
                    self.on_retained(node, True)
            else:
                cover.pop(node, None)
                self.on_retained(node, False)
