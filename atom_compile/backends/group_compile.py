"""The ranks of a process group agree on who compiles which piece of one graph.

Dynamo traces the whole graph on every rank before the backend sees it, and the ranks of an
SPMD program reach the backend for the same graphs in the same order; so once per graph:

1. each rank computes the content keys of its compiles (every piece's general shape, each
   compile range and each compile size: `PieceCompile`) and keeps those that neither its own
   cache nor the shared store (cache/shared.py) already holds;
2. the ranks exchange those keys (`all_gather_object` over a gloo group, groups.py);
3. every rank derives the same owners: the union of keys, sorted, dealt round-robin over the
   ranks that need each key, least-loaded first (a rank-specific piece goes to its own rank);
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
    peer_problem: Optional[str] = None
    owners: dict[int, int] = field(default_factory=dict)


# one GroupStats per graph compiled in this process, in order (benchmarks read it)
history: list[GroupStats] = []


def assign_owners(needed: list[list[str]]) -> dict[str, int]:
    """Content key -> the rank that compiles it, from each rank's list of keys it lacks. The
    same on every rank: keys sorted, each dealt to the least-loaded rank that needs it, ties
    broken round-robin from the key's position."""
    world = len(needed)
    sets = [set(keys) for keys in needed]
    load = [0] * world
    owners: dict[str, int] = {}
    for i, key in enumerate(sorted(set().union(*sets))):
        owner = min((r for r in range(world) if key in sets[r]), key=lambda r: (load[r], (r - i) % world))
        owners[key] = owner
        load[owner] += 1
    return owners


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
        missing = sorted({p.key for p in pieces if not _cached(manager, p.key)})
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
        gathered = handle.all_gather((probe, missing))
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
    mates = [r for r, (theirs, _) in enumerate(gathered)
             if r == handle.rank or (shared is not None and shared.sees(theirs))]
    needed = [gathered[r][1] if r in mates else [] for r in range(len(gathered))]
    owners = assign_owners(needed)
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

