"""Pieces shared by the ranks of a tensor-parallel group: stored once, compiled by one rank.

Layout, beside the per-rank directories of one `<hash>`::

    <hash>/shared/<prefix>/artifacts/<digest>.bin    hard links of the ranks' artifacts
    <hash>/shared/<prefix>/content/<content key>.json  which artifact holds that content
    <hash>/shared/<prefix>/locks/<content key>.lock    held by the rank compiling it
    <hash>/shared/<prefix>/locks/<content key>.owner   "<rank> <pid>" while it compiles
    <hash>/shared/<prefix>/locks/probe-<random>        a rank's probe while the group agrees

A piece's content key covers its code, shapes and constants, so equal keys on two ranks mean
the same compiled code. The rank that takes a key's lock first compiles and publishes; the
others wait on the lock, then find the record and link the artifact into their own directory
(one inode: stored once). The lock is an flock, which the kernel drops when its holder dies,
so a killed owner never blocks the others; an `.owner` file left behind names the dead one.
A live owner that does not finish within the timeout is passed by: the waiter compiles itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

import filelock

from . import trust
from .index import INDEX_FILE, SHA_RE, check_rel_path
from .scratch import SCRATCH_DIR as SCRATCH_DIR_NAME
from .files import atomic_write
from .store import PieceCache, damage, digest_problem, warn_once

logger = logging.getLogger("atom_compile")

SHARED_DIR = "shared"
PROBE_RE = re.compile(r"probe-[0-9a-f]{32}")
_RECORD_KEYS = ("content_key", "graph", "compiler", "handle", "sha256", "bytes")


class SharedPieces:
    """The shared directory of one PieceCache's `<hash>` and prefix."""

    def __init__(self, cache: PieceCache, rank: int, timeout: float):
        self.cache = cache
        self.rank = rank
        self.timeout = timeout
        self.path = cache.hash_path / SHARED_DIR / cache.path.name
        self.ready = False
        self.peer_warned = False  # a peer's failure was already named (the group's barrier)
        # monotonic time past which a lock is not waited for (the group's barrier already
        # waited one timeout for the owners): None waits `timeout` per lock
        self.deadline: Optional[float] = None
        self._probe: Optional[str] = None

    def _dirs(self) -> bool:
        if not self.ready:
            try:
                for sub in ("artifacts", "content", "locks"):
                    trust.make_private_dirs(self.cache.root, self.path / sub)
                problem = trust.path_problem(self.cache.root, self.path)
            except OSError as exc:
                problem = exc.strerror or str(exc)
            if problem is not None:
                warn_once(f"shared:{self.path}", "atom-compile: not sharing pieces through %s (%s); "
                          "this rank compiles its pieces itself.", self.path, problem)
                return False
            self.ready = True
        return True

    @contextlib.contextmanager
    def claim(self, ck: str) -> Iterator[bool]:
        """Hold the content key's lock while the block looks up, compiles and publishes it.
        Yields False (no lock) when there is no shared directory or the owner timed out."""
        if not self.cache.writable or not self._dirs():
            yield False
            return
        name = ck[:32]
        wait = self.timeout if self.deadline is None else min(self.timeout, max(0.0, self.deadline - time.monotonic()))
        lock = filelock.FileLock(str(self.path / "locks" / f"{name}.lock"), timeout=wait, mode=trust.FILE_MODE)
        try:
            lock.acquire()
        except filelock.Timeout:
            if not self.peer_warned:
                warn_once(f"peer-timeout:{self.path}", "atom-compile: a peer has been compiling piece %s... for "
                          "more than %.0fs (ATOM_COMPILE_PEER_TIMEOUT); compiling it on rank %d instead.",
                          name[:12], self.timeout, self.rank)
            yield False
            return
        owner = self.path / "locks" / f"{name}.owner"
        try:
            self._note_dead_owner(owner, name)
            _write_quiet(owner, f"{self.rank} {os.getpid()}\n".encode())
            yield True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(owner)
            lock.release()

    def _note_dead_owner(self, owner: Path, name: str) -> None:
        if self.peer_warned:
            return
        try:
            who = owner.read_text().split()
        except (OSError, UnicodeDecodeError):
            return
        warn_once(f"dead-owner:{self.path}", "atom-compile: rank %s (pid %s) died while compiling piece "
                  "%s...; compiling it on rank %d.", who[0] if who else "?", who[1] if len(who) > 1 else "?",
                  name[:12], self.rank)

    def probe(self) -> Optional[str]:
        """Write a fresh, empty probe file into this store and return its name: a rank that
        finds it sees the same store (group_compile.py). None without a usable directory. A
        probe rather than a token stored once: a copied cache root (an image, an rsync) would
        carry a token to stores that are not the same one."""
        if not self.cache.writable or not self._dirs():
            return None
        name = f"probe-{uuid.uuid4().hex}"
        try:
            atomic_write(self.path / "locks" / name, b"")
        except OSError:
            return None
        self._probe = name
        return name

    def sees(self, probe: object) -> bool:
        """Whether another rank's probe (its name, as that rank sent it) is in this store."""
        return isinstance(probe, str) and PROBE_RE.fullmatch(probe) is not None and self.ready \
            and os.path.lexists(self.path / "locks" / probe)

    def drop_probe(self) -> None:
        """Remove this rank's probe (once every rank has looked for it)."""
        if self._probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path / "locks" / self._probe)
            self._probe = None

    def lookup(self, ck: str) -> Optional[dict]:
        """The published record of `ck`, or None (absent, or damaged: named once)."""
        path = self.path / "content" / f"{ck[:32]}.json"
        if not os.path.lexists(path):
            return None
        try:
            record = trust.loads_bounded(trust.read_bytes(self.cache.root, path, trust.MAX_JSON_BYTES).decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, trust.Untrusted) as exc:
            damage(path, f"it cannot be read ({exc})", "compiling the piece here.")
            return None
        if not isinstance(record, dict) or any(k not in record for k in _RECORD_KEYS) \
                or record["content_key"] != ck or not SHA_RE.match(str(record["sha256"])) \
                or not isinstance(record["handle"], dict):
            damage(path, "it is not a record of this piece", "compiling the piece here.")
            return None
        try:
            check_rel_path(record["handle"].get("path"))
        except ValueError as exc:
            damage(path, str(exc), "compiling the piece here.")
            return None
        return {k: record[k] for k in _RECORD_KEYS}

    def adopt(self, record: dict) -> Optional[dict]:
        """Link the shared artifact of `record` into this rank's directory; the entry, or None."""
        rel = record["handle"]["path"]
        source = self.path / rel
        if self.cache.verify(rel, record["sha256"]) is None:
            return dict(record)
        problem = digest_problem(self.cache.root, source, record["sha256"])
        if problem is not None:
            # Usually the same inode as a rank's artifact already named as damage: not counted
            # again. This rank compiles the piece and its publish replaces the file.
            logger.debug("atom-compile: shared artifact %s unusable (%s); compiling the piece", source, problem)
            return None
        target = self.cache.artifact_path(rel)
        if trust.path_problem(self.cache.root, self.cache.path) is not None:
            return None  # never write into a directory we do not trust (already named as damage)
        try:
            _link(self.cache.root, source, target)
        except OSError as exc:
            self.cache.write_failed(target, exc)
            return None
        return dict(record)

    def borrow_libraries(self, scratch: Path) -> int:
        """Link into `scratch` (this rank's Inductor directory) the compiled C++ libraries that
        the other ranks' directories of this cache hold and it lacks, each checked against the
        digest that rank's committed index records. A CPU artifact names its library without
        carrying it: loading a peer's piece would otherwise run the C++ compiler again on every
        rank. Returns how many were linked."""
        linked = 0
        for index_path in sorted(self.cache.hash_path.glob(f"rank_*/{self.cache.path.name}/{INDEX_FILE}")):
            sibling = index_path.parent
            if sibling == self.cache.path:
                continue
            for rel, digest in _libraries(self.cache.root, index_path).items():
                target = scratch / rel
                if os.path.lexists(target):
                    continue
                source = sibling / SCRATCH_DIR_NAME / rel
                try:
                    if trust.sha256_trusted(self.cache.root, source) != digest:
                        continue
                    _link(self.cache.root, source, target)
                except (OSError, trust.Untrusted):
                    continue
                linked += 1
        return linked

    def publish(self, entry: dict) -> None:
        """Make a freshly compiled artifact (already in this rank's directory) shared."""
        if not self._dirs():
            return
        rel = entry["handle"]["path"]
        target = self.path / rel
        try:
            # Replaced even when present: a damaged shared file must not outlive a fresh compile.
            _link(self.cache.root, self.cache.artifact_path(rel), target)
            record = {k: entry[k] for k in _RECORD_KEYS}
            atomic_write(self.path / "content" / f"{entry['content_key'][:32]}.json",
                         (json.dumps(record, sort_keys=True) + "\n").encode())
        except OSError as exc:
            warn_once(f"shared-write:{self.path}", "atom-compile: cannot share a piece through %s (%s); "
                      "the other ranks compile it themselves.", self.path, exc.strerror or exc)


def _libraries(root: Path, index_path: Path) -> dict[str, str]:
    """{path under the scratch directory: sha256} of the shared libraries an index records."""
    try:
        index = trust.loads_bounded(trust.read_bytes(root, index_path, trust.MAX_JSON_BYTES).decode())
    except (OSError, ValueError, trust.Untrusted):
        return {}
    files = index.get("inductor_files") if isinstance(index, dict) else None
    out = {}
    for rel, digest in (files.items() if isinstance(files, dict) else ()):
        try:
            check_rel_path(rel)
        except ValueError:
            continue
        if rel.endswith(".so") and isinstance(digest, str) and SHA_RE.match(digest):
            out[rel] = digest
    return out


def _link(root: Path, source: Path, target: Path) -> None:
    """`target` becomes a hard link of `source`, atomically (a new link renamed over it)."""
    trust.make_private_dirs(root, target.parent)
    tmp = target.with_name(f".link-{os.getpid()}-{target.name}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.link(source, tmp)
    os.replace(tmp, target)
    # rename() of two links of one file does nothing and leaves the source name behind
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def _write_quiet(path: Path, data: bytes) -> None:
    with contextlib.suppress(OSError):
        atomic_write(path, data)
