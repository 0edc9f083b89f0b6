"""The ranks of a process group agree on who compiles which piece of one graph.

Dynamo traces the whole graph on every rank before the backend sees it, and the ranks of an
SPMD program reach the backend for the same graphs in the same order; so once per graph:

1. each rank computes the content keys of its compiles (every piece's general shape, each
   compile range and each compile size: `PieceCompile`) and keeps those that neither its own
   cache nor the shared store (cache/shared.py) already holds;
2. the ranks exchange those keys (`all_gather_object` over a gloo group, groups.py);
3. every rank derives the same owners: the union of keys, costliest first, dealt over the
   ranks that need each key, least-loaded first (a rank-specific piece goes to its own rank);
   the shared ones over at most `owner_count` ranks, one per COST_PER_OWNER of work (or
   ATOM_COMPILE_GROUP_OWNERS), since every owner pays Inductor's fixed set-up once;
4. each rank compiles its own share, in parallel with the others, and publishes it into the
   shared store;
5. a barrier with a timeout (ATOM_COMPILE_PEER_TIMEOUT; a monitored barrier names the rank
   that did not come); a rank that died or hung in its share is passed by with one warning;
6. every rank takes the rest through the compile-or-load path: what a peer published is
   loaded, what a dead peer left undone is compiled here (under the content key's lock, so
   two survivors still compile it once). After a failed barrier the lock waits are bounded by
   what is left of the same timeout (plus LOCK_GRACE_S): a hung owner, which still holds its
   key's lock, costs one timeout, not two.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Union

import torch.fx as fx

from ..groups import GroupHandle
from .manager import CompilerManager

logger = logging.getLogger("atom_compile")

# after a failed barrier, how long past the timeout a survivor still waits for a key's lock
# (a slow owner that is just publishing); then it compiles the key itself
LOCK_GRACE_S = 2.0

# compile work (unit_cost: graph operations) worth one more owning rank under the automatic
# owner count. Each owner pays Inductor's first-compile set-up once (imports and warm-up, about
# 3 s of CPU on CPU, the cost of some 50 operations at 0.05-0.07 s each): at 500 an owner's
# set-up is at most a tenth of its work (BENCHMARKS.md, issue 16)
COST_PER_OWNER = 500


@dataclass
class Piece:
    """A piece the interpreter reached: compiled only once the ranks have agreed."""

    target: str
    graph: fx.GraphModule
    args: list[Any]
    index: int
    locator: Optional[list[int]]


@dataclass
class PieceCompile:
    """One compile of a piece: its general shape (shape None), a compile range ("lo-hi") or
    a compile size (an int, `args` bound to it); the unit the ranks deal out."""

    piece: Piece
    shape: Union[None, int, str]
    args: list[Any]
    key: str = ""
    fn: Optional[Callable] = None


@dataclass
class GroupStats:
    """What one graph's agreement did on this rank (seconds are wall time)."""

    pieces: int = 0  # compiles (general shapes, ranges, sizes) of the graph's pieces
    missing: int = 0
    unique_missing: int = 0
    owned: int = 0
    exchange_s: float = 0.0
    share_s: float = 0.0
    barrier_s: float = 0.0
    rest_s: float = 0.0
    cost: int = 0  # unit_cost of the missing units, summed over the group
    max_owners: int = 0  # how many ranks the shared units were dealt over (owner_count)
    peer_problem: Optional[str] = None
    owners: dict[int, int] = field(default_factory=dict)


# one GroupStats per graph compiled in this process, in order (benchmarks read it)
history: list[GroupStats] = []


def unit_cost(graph: fx.GraphModule) -> int:
    """The compile work of one unit, estimated the same way on every rank: its graph's
    operations (call nodes); Inductor's time grows with them."""
    return sum(1 for node in graph.graph.nodes if node.op in ("call_function", "call_method", "call_module"))


def owner_count(total_cost: int, world: int, limit: Optional[int] = None,
                cost_per_owner: int = COST_PER_OWNER) -> int:
    """How many ranks compile the shared units: `limit` when set (clamped to 1..world), else
    one owner per `cost_per_owner` of work, so that a few cheap pieces do not make several
    processes each pay Inductor's fixed first-compile set-up."""
    if limit is not None:
        return max(1, min(world, limit))
    return max(1, min(world, total_cost // max(1, cost_per_owner)))


def assign_owners(needed: list[list[str]], costs: Optional[dict[str, int]] = None,
                  max_owners: Optional[int] = None) -> dict[str, int]:
    """Content key -> the rank that compiles it, from each rank's list of keys it lacks; pure,
    so every rank derives the same map. A key only one rank lacks (rank-specific) stays with
    that rank; the others go to at most `max_owners` ranks (None: all): the ranks that own a
    rank-specific key first (they pay the set-up anyway), then those that lack the most keys,
    lowest rank first. Keys are dealt costliest first (`costs`, default 1 each; ties by key),
    each to the least-loaded allowed rank that lacks it, ties broken round-robin from the key's
    position; a key no allowed rank lacks makes the least-loaded rank that lacks it an owner."""
    world = len(needed)
    sets = [set(keys) for keys in needed]
    cost = (lambda k: costs.get(k, 1)) if costs else (lambda k: 1)
    keys = sorted(set().union(*sets), key=lambda k: (-cost(k), k))
    lacking = {k: [r for r in range(world) if k in sets[r]] for k in keys}
    allowed = _allowed_owners(sets, lacking, world if max_owners is None else max(1, max_owners))
    load = [0] * world
    owners: dict[str, int] = {}
    for i, key in enumerate(keys):
        owner = min(lacking[key], key=lambda r: (r not in allowed, load[r], (r - i) % world))
        allowed.add(owner)  # a key no allowed rank lacks makes one more owner, which keeps it
        owners[key] = owner
        load[owner] += cost(key)
    return owners


def _allowed_owners(sets: list[set[str]], lacking: dict[str, list[int]], limit: int) -> set[int]:
    """The ranks that may own shared keys: every owner of a rank-specific key, then up to
    `limit` in all, those lacking the most keys first."""
    forced = {ranks[0] for ranks in lacking.values() if len(ranks) == 1}
    rest = sorted((r for r in range(len(sets)) if r not in forced and sets[r]), key=lambda r: (-len(sets[r]), r))
    return forced | set(rest[:max(0, limit - len(forced))])


def _cached(manager: CompilerManager, key: str) -> bool:
    """Whether `key` is compiled already, here or in the shared store (no compile needed)."""
    name = manager.compiler.name
    if key in manager._by_content or any(e["content_key"] == key and e["compiler"] == name
                                         for e in manager.entries.values()):
        return True
    record = manager.shared.lookup(key) if manager.shared is not None else None
    return record is not None and record["compiler"] == name


def compile_with_group(handle: GroupHandle, manager: CompilerManager, pieces: list[PieceCompile],
                       compile_one: Callable[[PieceCompile], None], fake: Callable[[], ContextManager]) -> GroupStats:
    """Agree with the group, compile this rank's share, wait for the others, then take the
    rest; `compile_one(c)` compiles (or loads) one compile and sets `c.fn` (under `fake()`)."""
    stats = GroupStats(pieces=len(pieces))
    owners = _exchange(handle, manager, pieces, fake, stats)
    if owners is None:  # no agreement: every piece through the locks
        with fake():
            for piece in pieces:
                compile_one(piece)
        return _done(stats)
    compiled: set[int] = set()
    start = time.perf_counter()
    error: Optional[BaseException] = None
    manager.commit_on_release = False  # the flush before the barrier commits the shares
    try:
        with fake():
            done: set[str] = set()
            for piece in pieces:
                if owners.get(piece.key) == handle.rank and piece.key not in done:
                    compile_one(piece)
                    done.add(piece.key)
                    compiled.add(id(piece))
                    stats.owned += 1
    except Exception as exc:  # strict mode's refusal, a compiler error: the others still get their barrier
        error = exc
    finally:
        manager.commit_on_release = True
    stats.share_s = time.perf_counter() - start
    manager.flush()
    deadline = _wait_for_owners(handle, manager, owners, stats)
    if error is not None:
        raise error
    start = time.perf_counter()
    try:
        if deadline is not None and manager.shared is not None:
            manager.shared.deadline = deadline
        with fake():
            for piece in pieces:
                if id(piece) not in compiled:
                    compile_one(piece)
    finally:
        if manager.shared is not None:
            manager.shared.deadline = None
    stats.rest_s = time.perf_counter() - start
    return _done(stats)


def _exchange(handle: GroupHandle, manager: CompilerManager, pieces: list[PieceCompile],
              fake: Callable[[], ContextManager], stats: GroupStats) -> Optional[dict[str, int]]:
    """Each piece's content key set; the owners the group agreed on, or None (no agreement)."""
    with fake():
        for piece in pieces:
            piece.key = manager.content_key_of(piece.piece.graph, piece.args, piece.shape)
        missing = {p.key: unit_cost(p.piece.graph) for p in pieces if not _cached(manager, p.key)}
    stats.missing = len(missing)
    start = time.perf_counter()
    # every rank must be here: one whose cache let it skip Dynamo (and us) never comes, and
    # waiting for it in the exchange would take the group's whole collective timeout
    shared = manager.shared
    probe = shared.probe() if shared is not None else None
    absent = handle.barrier()
    try:
        if absent is not None:
            raise RuntimeError(absent.split(". ")[0])
        gathered = handle.all_gather((probe, missing, handle.max_owners))
    except Exception as exc:  # a peer gone before the exchange: the locks still coordinate
        if shared is not None:
            shared.drop_probe()
        why = str(exc).splitlines()[0][:300] if str(exc) else exc
        logger.warning("atom-compile: the ranks could not exchange their pieces (%s); each rank takes its "
                       "pieces through the cache directory's locks.", why)
        return None
    stats.exchange_s = time.perf_counter() - start
    # only ranks that see the same shared store can load what the others compile: the
    # agreement runs among those whose probe file this rank finds in its store (node-local
    # cache roots: each node's ranks split its pieces). The all_gather follows every probe's
    # write, and the probes stay until the barrier after the shares.
    mates = [r for r, (theirs, _, _) in enumerate(gathered)
             if r == handle.rank or (shared is not None and shared.sees(theirs))]
    needed = [sorted(gathered[r][1]) if r in mates else [] for r in range(len(gathered))]
    costs = {key: cost for r in mates for key, cost in gathered[r][1].items()}
    # every rank's setting travels with its keys: the smallest one set decides, everywhere
    limits = [limit for _, _, limit in gathered if limit is not None]
    stats.cost = sum(costs.values())
    stats.max_owners = owner_count(stats.cost, len(mates), min(limits) if limits else None)
    owners = assign_owners(needed, costs, stats.max_owners)
    stats.unique_missing = len(owners)
    for owner in owners.values():
        stats.owners[owner] = stats.owners.get(owner, 0) + 1
    return owners


def _wait_for_owners(handle: GroupHandle, manager: CompilerManager, owners: dict[str, int],
                     stats: GroupStats) -> Optional[float]:
    """The barrier after the shares; a rank that did not come is named once. Returns None, or
    after a failed barrier the monotonic time past which no lock is waited for any more."""
    start = time.perf_counter()
    deadline = time.monotonic() + handle.timeout + LOCK_GRACE_S
    problem = handle.barrier()  # every rank, even one with nothing to compile: the same collectives
    stats.barrier_s = time.perf_counter() - start
    if manager.shared is not None:
        manager.shared.drop_probe()  # every rank that passed the barrier has looked for it
    if problem is None:
        return None
    problem = problem.split(". ")[0]
    stats.peer_problem = problem
    left = sum(1 for owner in owners.values() if owner != handle.rank)
    logger.warning("atom-compile: not every rank finished its share of the compile within %.0fs "
                   "(ATOM_COMPILE_PEER_TIMEOUT): %s; rank %d compiles what is missing of the %d pieces "
                   "the others owned.", handle.timeout, problem, handle.rank, left)
    if manager.shared is not None:
        manager.shared.peer_warned = True  # the one warning: the lock path stays quiet
    return deadline


def _done(stats: GroupStats) -> GroupStats:
    history.append(stats)
    logger.debug("atom-compile: group compile: %s", stats)
    return stats

