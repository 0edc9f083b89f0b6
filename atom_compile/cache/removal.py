"""Remove whole caches safely, and choose which to remove (all, older than, least recently used).

Removal takes the cache's `.in_use` flock exclusively (failing at once if any process holds it
shared) and every index lock of the cache, so no reader or writer sees half a cache.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import filelock

from . import trust
from .inventory import ENTRYPOINTS, CacheInfo, entrypoints
from .store import IN_USE_FILE, caches_dir


@dataclass
class Removal:
    hash: str
    bytes: int
    removed: bool
    reason: Optional[str] = None  # why it was kept


def _try_exclusive(path: Path) -> Optional[int]:
    """An fd holding an exclusive flock on `path`, or None if a process holds it (shared)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), trust.FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_cache(root: Path, info: CacheInfo) -> Removal:
    """Remove one whole cache, unless a running process uses it (its `.in_use` flock).

    Held while removing: `.in_use` exclusively (new users fail to take it shared, and get a
    correct result without the cache) and every index lock (no commit is half-way). The
    directory is renamed away first, so nobody finds a half-removed cache under its hash.
    """
    refusal = _refusal(root, info)
    if refusal is not None:
        return Removal(info.hash, info.bytes, False, refusal)
    try:
        fd = _try_exclusive(info.path / IN_USE_FILE)
    except OSError as exc:
        return Removal(info.hash, info.bytes, False, f"cannot lock it ({exc.strerror or exc})")
    if fd is None:
        return Removal(info.hash, info.bytes, False, "in use by a running process")
    try:
        doomed = _move_aside(root, info)
    except filelock.Timeout:
        return Removal(info.hash, info.bytes, False, "an index lock is held (a compile is writing to it)")
    except OSError as exc:
        return Removal(info.hash, info.bytes, False, f"cannot remove it ({exc.strerror or exc})")
    finally:
        os.close(fd)
    try:
        trust.remove_tree(root, doomed)
    except OSError as exc:  # moved aside already: hidden, never used again
        return Removal(info.hash, info.bytes, True, f"left {doomed} ({exc})")
    return Removal(info.hash, info.bytes, True)


def _refusal(root: Path, info: CacheInfo) -> Optional[str]:
    """Why a cache must not be removed: it is a link, or reached through an untrusted directory
    (removal never follows a link out of the root, nor deletes where others can write)."""
    if os.path.islink(info.path):
        return "it is a symbolic link; not following it out of the cache root"
    problem = trust.path_problem(root, caches_dir(root))
    if problem is not None:
        return f"untrusted: {problem}"
    for piece in info.pieces:
        lock = piece.path / ".index.lock"
        if os.path.islink(lock):
            os.unlink(lock)  # a link where a lock belongs: taking the lock would follow it
    return None


def _move_aside(root: Path, info: CacheInfo) -> Path:
    """Under every index lock of the cache, rename it into a fresh `.removing-*` directory."""
    with contextlib.ExitStack() as stack:
        for piece in info.pieces:
            stack.enter_context(filelock.FileLock(str(piece.path / ".index.lock"), timeout=10))
        doomed = Path(tempfile.mkdtemp(prefix=f".removing-{info.hash}-", dir=str(caches_dir(root))))
        try:
            os.replace(info.path, doomed / info.hash)
        except OSError:
            os.rmdir(doomed)
            raise
    return doomed


def remove_entrypoints(root: Path, hashes: Iterable[str], unreadable: bool = False) -> list[Path]:
    """Delete the entry points that name one of `hashes` (and unreadable ones if asked)."""
    wanted = set(hashes)
    removed = []
    for ep in entrypoints(root):
        if ep.hash in wanted or (unreadable and ep.hash is None):
            try:
                trust.unlink_in(root, caches_dir(root) / ENTRYPOINTS / ep.path.name)
                removed.append(ep.path)
            except OSError:
                pass
    return removed


def select_older(caches: Iterable[CacheInfo], days: float, now: Optional[float] = None) -> list[CacheInfo]:
    """Caches not used for more than `days` days."""
    limit = (now if now is not None else time.time()) - days * 86400.0
    return [c for c in caches if (c.last_used or 0.0) < limit]


def select_lru(caches: Iterable[CacheInfo], max_bytes: int) -> list[CacheInfo]:
    """Least recently used caches to remove, oldest first, until the rest fits `max_bytes`."""
    ordered = sorted(caches, key=lambda c: c.last_used or 0.0)
    total = sum(c.bytes for c in ordered)
    out = []
    for cache in ordered:
        if total <= max_bytes:
            break
        out.append(cache)
        total -= cache.bytes
    return out

