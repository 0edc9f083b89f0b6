"""Which process group the ranks agree over, and how they exchange Python objects on it.

One place for the group plumbing that the compiler (who compiles which piece, backends/
group_compile.py) and the runtime (which bucket data-parallel ranks pad to, runtime/buckets.py)
both use:

- `set_compile_group(group)`: the group the backend agrees over. `None` (the default) means the
  default group whenever `torch.distributed` is initialised with more than one rank; `False`
  turns the agreement off (the ranks then coordinate through the cache directory's locks only).
  ATOM_COMPILE_GROUP_COMPILE=0 turns it off too. The group is process state, never part of
  the cache key: the compiled code does not depend on who compiled it.
- `object_group(group)`: a gloo group over the same ranks, for `all_gather_object` and
  `monitored_barrier` (gloo only). A gloo group is used as it is; for the default group of
  another backend (nccl, rccl) a gloo side group is made once with `dist.new_group(backend=
  "gloo")`, a collective every rank reaches in the same order (the backend does: SPMD).
- `tensor_device(group)`: where a tensor for a collective on `group` must live.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger("atom_compile")

_choice: Any = None  # None: the default group when initialised; False: off; else a group
_side_groups: dict[int, Any] = {}
_warned: set[str] = set()


def set_compile_group(group: Any = None) -> None:
    """The process group whose ranks agree on who compiles which piece: a group, None (the
    default group when torch.distributed is initialised) or False (no agreement: locks only)."""
    global _choice
    if group is not None and group is not False:
        import torch.distributed as dist

        if not isinstance(group, dist.ProcessGroup):
            from .errors import AtomTypeError

            raise AtomTypeError(f"set_compile_group: got {type(group).__name__}; allowed: a "
                                "torch.distributed ProcessGroup, None (the default group) or False (off)")
    _choice = group


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def initialized() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:  # pragma: no cover - a broken torch.distributed build
        return False


@dataclass
class GroupHandle:
    """A group to agree over: its ranks, this rank's place in it, the gloo group for objects."""

    group: Any
    objects: Any
    rank: int
    world: int
    timeout: float
    max_owners: Optional[int] = None  # at most this many ranks compile shared pieces (None: by cost)

    def all_gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.objects)
        return out

    def barrier(self) -> Optional[str]:
        """Wait for every rank, at most `timeout` seconds; None, or why not every rank came."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.objects, timeout=datetime.timedelta(seconds=self.timeout),
                                   wait_all_ranks=True)
        except Exception as exc:  # a peer died or hung: gloo names it in the message
            return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return None


def compile_group(enabled: bool = True, timeout: float = 600.0,
                  max_owners: Optional[int] = None) -> Optional[GroupHandle]:
    """The group the backend agrees over now, or None (no group, one rank, or turned off);
    `max_owners` caps the ranks that compile shared pieces (None: chosen by their cost)."""
    if not enabled or _choice is False or not initialized():
        return None
    import torch.distributed as dist

    group = _choice if _choice is not None else dist.group.WORLD
    try:
        world = dist.get_world_size(group)
        if world < 2:
            return None
        objects = object_group(group, timeout)
        if objects is None:
            return None
        return GroupHandle(group, objects, dist.get_rank(group), world, timeout, max_owners)
    except Exception as exc:  # a half-initialised or destroyed group: the locks still work
        _warn_once("group", "atom-compile: cannot use the process group to agree on compiles (%s); "
                   "the ranks coordinate through the cache directory instead.", exc)
        return None


def ranks_without(have: bool, enabled: bool = True, timeout: float = 600.0) -> list[int]:
    """The ranks of the compile group where `have` is False ([] with no group), from one
    exchange: for a choice every rank must make alike. A rank that loads its saved forward
    skips the agreement that a rank which traces waits in (and the model's collectives would
    meet that rank's exchange on the same group)."""
    handle = compile_group(enabled, timeout)
    if handle is None:
        return []
    return [rank for rank, ok in enumerate(handle.all_gather(bool(have))) if not ok]


def object_group(group: Any, timeout: float = 600.0) -> Optional[Any]:
    """A gloo group over the ranks of `group` (itself when it is gloo); None when there is none
    to be had (a non-default group of another backend: pass a gloo group to set_compile_group)."""
    import torch.distributed as dist

    if _backend(group) == "gloo":
        return group
    key = id(group)
    if key not in _side_groups:
        if group is not dist.group.WORLD and group is not None:
            _warn_once("side", "atom-compile: the compile group uses backend %s and is not the default "
                       "group; pass a gloo group over the same ranks to set_compile_group to agree over it "
                       "(the ranks coordinate through the cache directory meanwhile).", _backend(group))
            return None
        _side_groups[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(timeout, 60.0)))
    return _side_groups[key]


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:
        return "unknown"


def tensor_device(group: Any) -> str:
    """Where a tensor for a collective on `group` must live: cpu for gloo, else the GPU."""
    backend = _backend(group)
    return "cpu" if "gloo" in backend and "nccl" not in backend else "cuda"
