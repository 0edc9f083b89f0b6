"""The cache on disk: layout, trust checks, the JSON index, atomic writes under a file lock.

Layout::

    <root>/torch_compile_cache/<hash>/cache_key_factors.json
    <root>/torch_compile_cache/<hash>/rank_<rank>/<prefix>/index.json
    <root>/torch_compile_cache/<hash>/rank_<rank>/<prefix>/artifacts/<content key>.bin

The index is plain JSON (read without executing anything); every artifact carries a sha256
that is checked before the artifact is loaded, because loading an artifact runs its code. A
directory owned by another user or writable by group/others is refused for the same reason.
Any failure to read or write gives one warning and a correct result without the cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import filelock

from .. import envs
from ..errors import AtomValueError, IndexInvalid
from . import scratch, trust
from .files import atomic_write
from .index import (  # noqa: F401  (re-exported: the layout's readers import them from here)
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    bind,
    check_rel_path,
    entry_binding,
    entry_key,
    new_document,
    parse_index,
)

logger = logging.getLogger("atom_compile")

CACHE_SUBDIR = "torch_compile_cache"
IN_USE_FILE = ".in_use"
LAST_USED_FILE = "last_used"
ISA_PROBE_DIR = "isa_probe"
HASH_RE = re.compile(r"^[0-9a-f]{16}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

FACTORS_FILE = "cache_key_factors.json"

_warned: set[str] = set()


def digest_problem(root: Path, path: Path, sha256: Any) -> Optional[str]:
    """None if `path` is a trusted file under `root` whose sha256 is `sha256`, else why not."""
    try:
        digest = trust.sha256_trusted(root, path)
    except FileNotFoundError:
        return "the file is missing"
    except trust.Untrusted as exc:
        return f"untrusted: {exc.path}: {exc.reason}"
    except OSError as exc:
        return f"the file cannot be read ({exc.strerror or exc})"
    if digest != sha256:
        return f"its sha256 is {digest[:12]}..., the index recorded {str(sha256)[:12]}..."
    return None


def _torch_version() -> Optional[str]:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)


_warned: set[str] = set()
_in_use_fds: dict[str, int] = {}


def warn_once(key: str, message: str, *args: Any) -> bool:
    """Log `message` once per `key` in this process; True if it was logged now."""
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(message, *args)
    return True


def damage(path: Any, reason: str, consequence: str) -> bool:
    """One warning per damaged path and reason (counted as a cache error); True if new."""
    from ..counters import compilation_counter

    if not warn_once(f"damage:{path}", "atom-compile: %s is unusable: %s; %s", path, reason, consequence):
        return False
    compilation_counter.num_cache_errors += 1
    return True


def open_cache_paths() -> list[str]:
    """The `<hash>` directories this process has opened (and holds in use)."""
    return list(_in_use_fds)


def cache_root(cache_dir: str = "") -> Path:
    """`cache_dir` if set, else $ATOM_COMPILE_CACHE_ROOT, else $XDG_CACHE_HOME/atom (~/.cache/atom).
    For the entry points (the CLI); the compiler gets its root from `envs.read()`."""
    return envs.cache_root(cache_dir)


def current_rank() -> int:
    """The global rank where torch.distributed is initialised, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception as exc:  # pragma: no cover - a half-initialised process group
        logger.debug("atom-compile: cannot read the distributed rank (%s); using rank 0", exc)
    return 0


def caches_dir(root: Path) -> Path:
    return Path(root) / CACHE_SUBDIR


def hash_dir(root: Path, cache_hash: str) -> Path:
    return caches_dir(root) / cache_hash


def trust_problem(root: Path, path: Path) -> Optional[str]:
    """Why `path` under `root` must not be trusted (it, or a directory from the root down to
    it, is a link, another user's, or writable by group/others); None if fine or absent."""
    if not os.path.lexists(path):
        return None
    return trust.path_problem(root, path)


def _touch_private(path: Path, dir_fd: Optional[int] = None) -> int:
    """An fd of `path` opened for writing, created 0600, never through a link."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, trust.FILE_MODE)
    os.fchmod(fd, trust.FILE_MODE)
    return fd


def _chain(cache: "PieceCache", rank: int) -> list[Path]:
    return [cache.root, caches_dir(cache.root), cache.hash_path, cache.hash_path / f"rank_{rank}", cache.path]


class PieceCache:
    """One `<hash>/rank_<rank>/<prefix>/` directory: its index and its artifacts."""

    def __init__(self, root: Path, cache_hash: str, rank: int, prefix: str):
        if not HASH_RE.match(cache_hash):
            raise AtomValueError(f"cache hash: got {cache_hash!r}; allowed: 16 hex digits")
        if not _PREFIX_RE.match(prefix):
            raise AtomValueError(f"prefix: got {prefix!r}; allowed: letters, digits, '_', '.', '-'")
        self.root = Path(os.path.abspath(root))
        self.cache_hash = cache_hash
        self.hash_path = hash_dir(self.root, cache_hash)
        self.path = self.hash_path / f"rank_{rank}" / prefix
        self.index_path = self.path / INDEX_FILE
        self.scratch_path = self.path / scratch.SCRATCH_DIR
        # shared by every cache under the root: Inductor's probe of the CPU's vector ISA
        self.isa_probe_path = caches_dir(self.root) / ISA_PROBE_DIR
        self.writable = True
        self._repair = False
        self._scratch_replaced = False  # a fresh scratch this process: its files must be hashed again

    # --- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: Path, cache_hash: str, rank: int, prefix: str) -> Optional["PieceCache"]:
        """The cache directory, created private if needed, or None (with a warning) if it is
        refused: a link, another user's or a group/world-writable directory on the way."""
        cache = cls(root, cache_hash, rank, prefix)
        chain = _chain(cache, rank)
        problem = next((p for p in (trust_problem(cache.root, d) for d in chain) if p), None)
        if problem is None:
            try:
                trust.make_private_dirs(cache.root, cache.path)
            except OSError as exc:
                if not cache.path.is_dir():
                    warn_once(f"mkdir:{cache.path}", "atom-compile: cannot create the cache directory %s (%s); "
                              "compiling without the cache.", cache.path, exc.strerror or exc)
                    return None
                cache.write_failed(cache.path, exc)
            problem = trust.path_problem(cache.root, cache.path)
        if problem is not None:
            warn_once(f"trust:{cache.path}", "atom-compile: not using the cache at %s: %s; loading an artifact "
                      "runs its code. Compiling without the cache.", cache.path, problem)
            return None
        cache._hold_in_use()
        cache.touch_last_used()
        return cache

    def _hold_in_use(self) -> None:
        """A shared lock on `<hash>/.in_use` for the life of the process: `clear` skips the cache."""
        key = str(self.hash_path)
        if key in _in_use_fds:
            return
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return
        try:
            fd = _touch_private(self.hash_path / IN_USE_FILE)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            _in_use_fds[key] = fd
        except OSError:
            pass  # read-only, or being cleared right now: nothing to protect

    def _lock(self) -> filelock.FileLock:
        lock = self.path / ".index.lock"
        if os.path.islink(lock):  # taking the lock would open (and truncate) the link's target
            os.unlink(lock)
        return filelock.FileLock(str(self.path / ".index.lock"), timeout=60, mode=trust.FILE_MODE)

    # --- the index ---------------------------------------------------------------------------

    def _read_text(self) -> str:
        data = trust.read_bytes(self.root, self.index_path, trust.MAX_JSON_BYTES)
        return data.decode()

    def read_index(self) -> dict:
        """The index document; an empty one (and a warning naming the file) if it is damaged
        or untrusted: the next commit rewrites it."""
        empty = {"entries": [], "dynamo_function": None, "inductor_files": {}}
        try:
            text = self._read_text()
        except FileNotFoundError:
            if self._has_artifacts():
                self._warn_index("it is missing, and artifacts are here that no index names")
            return empty
        except trust.Untrusted as exc:
            self._warn_index(exc.reason)
            return empty
        except (OSError, UnicodeDecodeError) as exc:
            self._warn_index(f"cannot read it ({getattr(exc, 'strerror', None) or exc})")
            return empty
        try:
            return parse_index(text)
        except IndexInvalid as exc:
            self._warn_index(str(exc))
            return empty

    def _has_artifacts(self) -> bool:
        try:
            return any(os.scandir(self.path / "artifacts")) or os.path.lexists(self.path / "dynamo_function.bin")
        except OSError:
            return False

    def _read_quiet(self) -> dict:
        try:
            return parse_index(self._read_text())
        except (OSError, UnicodeDecodeError, IndexInvalid):
            return {"entries": []}

    def _warn_index(self, reason: str) -> None:
        from ..counters import compilation_counter

        self._repair = True
        if warn_once(f"damage:{self.index_path}", "atom-compile: ignoring the cache index %s: %s; "
                     "recompiling and rewriting it.", self.index_path, reason):
            compilation_counter.num_cache_errors += 1

    def commit(self, entries: list[dict], remove: list[tuple] = (), dynamo_function: Any = None,
               scratch_used: bool = False) -> bool:
        """Merge `entries` into the index (and drop `remove`) under the lock, atomically; with
        `scratch_used`, record the manifest of Inductor's files as they are now."""
        if not self.writable or (not entries and not remove and dynamo_function is None
                                 and not self._repair and not scratch_used):
            return False
        try:
            with self._lock():
                current = self._read_quiet()
                merged = {entry_key(e): e for e in current.get("entries", [])}
                for key in remove:
                    merged.pop(key, None)
                for e in entries:
                    merged[entry_key(e)] = bind(e)
                files = None
                if scratch_used and self.scratch_path.is_dir():
                    scratch.make_private_tree(self.scratch_path)
                    only_scratch = not entries and not remove and dynamo_function is None and not self._repair
                    walked, _ = scratch.walk_stats(self.scratch_path)  # once, for the names and the digests
                    same_names = not self._scratch_replaced and only_scratch and \
                        set(walked) == set(current.get("inductor_files") or {})
                    # a start that only loaded: the same names as recorded means nothing to record
                    # (hashing every file costs a warm start ~0.2 s; a file changed in place is
                    # caught by the digest check of the next start, which repairs it)
                    if same_names:
                        return False
                    files = scratch.manifest(self.root, self.scratch_path, walked)
                    if only_scratch and files == current.get("inductor_files"):
                        return False
                doc = new_document(current, list(merged.values()), dynamo_function, files,
                                   _torch_version(), time.time())
                atomic_write(self.index_path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
                self._repair = False
                return True
        except (OSError, filelock.Timeout) as exc:
            self.write_failed(self.index_path, exc)
            return False

    def write_failed(self, path: Path, exc: BaseException) -> None:
        from ..counters import compilation_counter

        compilation_counter.num_cache_errors += 1
        self.writable = False
        reason = getattr(exc, "strerror", None) or str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            reason = "no space left on the device"
        warn_once(f"write:{self.path}", "atom-compile: cannot write the cache at %s (%s); "
                  "results stay correct, compiled pieces are kept in memory only.", path, reason)

    # --- artifacts and Inductor's files ------------------------------------------------------

    def artifact_path(self, rel: str) -> Path:
        return self.path / check_rel_path(rel)

    def verify(self, rel: str, sha256: str) -> Optional[str]:
        """None if the artifact is trusted, exists and matches its digest, else why not."""
        return digest_problem(self.root, self.artifact_path(rel), sha256)

    def read_artifact(self, rel: str, sha256: str) -> bytes:
        """The bytes of a trusted artifact whose digest is `sha256`; OSError/ValueError if not."""
        data = trust.read_bytes(self.root, self.artifact_path(rel))
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError("its sha256 does not match the index")
        return data

    def discard(self, rel: str) -> None:
        """Remove a damaged artifact (a link is removed, never followed)."""
        if not self.writable:
            return
        try:
            trust.unlink_in(self.root, self.artifact_path(rel))
        except OSError as exc:
            self.write_failed(self.artifact_path(rel), exc)

    def scratch_problem(self, recorded: dict[str, str]) -> Optional[str]:
        """Why Inductor's files here must not be used (None: each is trusted and digest-equal)."""
        return scratch.scratch_problem(self.root, self.scratch_path, recorded)

    def fresh_scratch(self, keep: dict[str, str]) -> dict[str, str]:
        """Swap a fresh private inductor/ in for a damaged one, with the files of `keep` that
        still match their digests; returns those. OSError if it cannot be done."""
        kept = scratch.fresh_scratch(self.root, self.scratch_path, keep)
        self._scratch_replaced = True
        return {rel: keep[rel] for rel in kept}

    def write_factors(self, factors: dict) -> None:
        """Write the key factors beside the pieces; a damaged copy is named once and rewritten."""
        path = self.hash_path / FACTORS_FILE
        if not self.writable:
            return
        data = (json.dumps(factors, indent=1, sort_keys=True, default=repr) + "\n").encode()
        try:
            if trust.read_bytes(self.root, path, trust.MAX_JSON_BYTES) == data:
                return
            damage(path, "it does not hold this cache's key factors", "rewriting it.")
        except FileNotFoundError:
            pass
        except trust.Untrusted as exc:
            damage(path, exc.reason, "rewriting it.")
        except OSError:
            pass
        try:
            trust.unlink_in(self.root, path)  # a damaged one (a link, another owner's) goes
            atomic_write(path, data)
        except OSError as exc:
            self.write_failed(path, exc)

    def write_text(self, name: str, text: str) -> None:
        if not self.writable:
            return
        try:
            atomic_write(self.path / name, text.encode())
        except OSError as exc:
            self.write_failed(self.path / name, exc)

    def touch_last_used(self) -> None:
        if not self.writable:
            return
        try:
            os.close(_touch_private(self.hash_path / LAST_USED_FILE))
            os.utime(self.hash_path / LAST_USED_FILE)
        except OSError:
            pass
