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
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import filelock

from .. import envs
from .._version import __version__
from ..errors import AtomValueError, IndexInvalid

logger = logging.getLogger("atom_compile")

CACHE_SUBDIR = "torch_compile_cache"
INDEX_FILE = "index.json"
INDEX_FORMAT = "atom-compile-index"
INDEX_VERSION = 1
IN_USE_FILE = ".in_use"
LAST_USED_FILE = "last_used"
HASH_RE = re.compile(r"^[0-9a-f]{16}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

FACTORS_FILE = "cache_key_factors.json"

_warned: set[str] = set()


def sha256_file(path: str) -> Optional[str]:
    """The file's sha256 (hex), or None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
    except OSError:
        return None


def digest_problem(path: Path, sha256: Any) -> Optional[str]:
    """None if `path` is a readable file whose sha256 is `sha256`, else why not."""
    if not Path(path).is_file():
        return "the file is missing"
    digest = sha256_file(str(path))
    if digest is None:
        return "the file cannot be read"
    if digest != sha256:
        return f"its sha256 is {digest[:12]}..., the index recorded {str(sha256)[:12]}..."
    return None


def _torch_version() -> Optional[str]:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)
_in_use_fds: dict[str, int] = {}


def warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


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


def _check_rel_path(rel: Any) -> str:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise IndexInvalid(f"artifact path {rel!r} is not a path inside the cache")
    return rel


def _check_entry(raw: Any) -> dict:
    if not isinstance(raw, dict):
        raise IndexInvalid("an entry is not an object")
    shape = raw.get("runtime_shape")
    if shape is not None and (isinstance(shape, bool) or not isinstance(shape, int) or shape <= 0):
        raise IndexInvalid(f"bad runtime_shape {shape!r}")
    index = raw.get("graph_index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise IndexInvalid(f"bad graph_index {index!r}")
    if not isinstance(raw.get("compiler"), str) or not isinstance(raw.get("content_key"), str):
        raise IndexInvalid("entry without compiler or content_key")
    handle = raw.get("handle")
    if not isinstance(handle, dict):
        raise IndexInvalid("entry without a handle")
    _check_rel_path(handle.get("path"))
    if not isinstance(raw.get("sha256"), str) or not _SHA_RE.match(raw["sha256"]):
        raise IndexInvalid(f"bad sha256 {raw.get('sha256')!r}")
    locator = raw.get("shape_locator")
    if locator is not None and not (isinstance(locator, list) and all(isinstance(x, int) for x in locator)):
        raise IndexInvalid(f"bad shape_locator {locator!r}")
    return raw


def entry_key(entry: dict) -> tuple:
    return (entry.get("runtime_shape"), entry["graph_index"], entry["compiler"])


def parse_index(text: str) -> dict:
    """Validate an index document; raise IndexInvalid with the reason."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IndexInvalid(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise IndexInvalid("not an atom-compile index")
    if data.get("format_version") != INDEX_VERSION:
        raise IndexInvalid(f"index format {data.get('format_version')!r}, this package reads {INDEX_VERSION}")
    if data.get("atom_compile_version") != __version__:
        raise IndexInvalid(
            f"written by atom-compile {data.get('atom_compile_version')!r}, this is {__version__}"
        )
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise IndexInvalid("no entries list")
    data["entries"] = [_check_entry(e) for e in entries]
    dynamo = data.get("dynamo_function")
    if dynamo is not None:
        if not isinstance(dynamo, dict) or not isinstance(dynamo.get("sha256"), str):
            raise IndexInvalid("bad dynamo_function record")
        _check_rel_path(dynamo.get("path"))
    return data


def trust_problem(path: Path) -> Optional[str]:
    """Why `path` must not be trusted (owned by someone else, or writable by group/others)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {oct(st.st_mode & 0o777)})"
    return None


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mkdir_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        return
    # mkdir's mode is cut by the umask only; an umask of 002 would leave it group-writable.
    os.chmod(path, 0o755)


class PieceCache:
    """One `<hash>/rank_<rank>/<prefix>/` directory: its index and its artifacts."""

    def __init__(self, root: Path, cache_hash: str, rank: int, prefix: str):
        if not HASH_RE.match(cache_hash):
            raise AtomValueError(f"cache hash: got {cache_hash!r}; allowed: 16 hex digits")
        if not _PREFIX_RE.match(prefix):
            raise AtomValueError(f"prefix: got {prefix!r}; allowed: letters, digits, '_', '.', '-'")
        self.root = Path(root)
        self.cache_hash = cache_hash
        self.hash_path = hash_dir(self.root, cache_hash)
        self.path = self.hash_path / f"rank_{rank}" / prefix
        self.index_path = self.path / INDEX_FILE
        self.writable = True
        self._repair = False

    # --- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: Path, cache_hash: str, rank: int, prefix: str) -> Optional["PieceCache"]:
        """The cache directory, created if needed, or None (with a warning) if it is refused."""
        cache = cls(root, cache_hash, rank, prefix)
        chain = [caches_dir(cache.root), cache.hash_path, cache.hash_path / f"rank_{rank}", cache.path]
        for part in chain:
            problem = trust_problem(part)
            if problem is not None:
                warn_once(f"trust:{part}", "atom-compile: not using the cache at %s: %s; loading an artifact "
                          "runs its code. Compiling without the cache.", part, problem)
                return None
        try:
            if not cache.root.is_dir():
                cache.root.mkdir(parents=True, exist_ok=True)
            for part in chain:
                if not part.is_dir():
                    _mkdir_private(part)
        except OSError as exc:
            if not cache.path.is_dir():
                warn_once(f"mkdir:{cache.path}", "atom-compile: cannot create the cache directory %s (%s); "
                          "compiling without the cache.", cache.path, exc.strerror or exc)
                return None
            cache.write_failed(cache.path, exc)
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
            fd = os.open(self.hash_path / IN_USE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            _in_use_fds[key] = fd
        except OSError:
            pass  # read-only, or being cleared right now: nothing to protect

    def _lock(self) -> filelock.FileLock:
        return filelock.FileLock(str(self.path / ".index.lock"), timeout=60)

    # --- the index ---------------------------------------------------------------------------

    def read_index(self) -> dict:
        """The index document; an empty one (and a warning naming the file) if it is damaged."""
        empty = {"entries": [], "dynamo_function": None}
        try:
            text = self.index_path.read_text()
        except FileNotFoundError:
            return empty
        except (OSError, UnicodeDecodeError) as exc:
            self._warn_index(f"cannot read it ({exc})")
            return empty
        try:
            return parse_index(text)
        except IndexInvalid as exc:
            self._warn_index(str(exc))
            return empty

    def _read_quiet(self) -> dict:
        try:
            return parse_index(self.index_path.read_text())
        except (OSError, UnicodeDecodeError, IndexInvalid):
            return {"entries": []}

    def _warn_index(self, reason: str) -> None:
        from ..counters import compilation_counter

        compilation_counter.num_cache_errors += 1
        self._repair = True
        logger.warning("atom-compile: ignoring the cache index %s: %s; recompiling and rewriting it.",
                       self.index_path, reason)

    def commit(self, entries: list[dict], remove: list[tuple] = (), dynamo_function: Any = None) -> bool:
        """Merge `entries` into the index (and drop `remove`) under the lock, atomically."""
        if not self.writable or (not entries and not remove and dynamo_function is None and not self._repair):
            return False
        try:
            with self._lock():
                current = self._read_quiet()
                merged = {entry_key(e): e for e in current.get("entries", [])}
                for key in remove:
                    merged.pop(key, None)
                for e in entries:
                    merged[entry_key(e)] = e
                now = time.time()
                doc = {
                    "format": INDEX_FORMAT,
                    "format_version": INDEX_VERSION,
                    "atom_compile_version": __version__,
                    "created": current.get("created", now),
                    "updated": now,
                    "entries": sorted(merged.values(), key=lambda e: (e["graph_index"], e.get("runtime_shape") or 0)),
                    "dynamo_function": dynamo_function if dynamo_function is not None else current.get("dynamo_function"),
                }
                doc["torch_version"] = _torch_version() or current.get("torch_version")
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

    # --- artifacts ---------------------------------------------------------------------------

    def artifact_path(self, rel: str) -> Path:
        return self.path / _check_rel_path(rel)

    def verify(self, rel: str, sha256: str) -> Optional[str]:
        """None if the artifact exists and matches its digest, else why not."""
        return digest_problem(self.artifact_path(rel), sha256)

    def discard(self, rel: str) -> None:
        if not self.writable:
            return
        try:
            self.artifact_path(rel).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.write_failed(self.artifact_path(rel), exc)

    def write_factors(self, factors: dict) -> None:
        path = self.hash_path / FACTORS_FILE
        if not self.writable or path.exists():
            return
        try:
            atomic_write(path, (json.dumps(factors, indent=1, sort_keys=True, default=repr) + "\n").encode())
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
        path = self.hash_path / LAST_USED_FILE
        try:
            path.touch()
            os.utime(path)
        except OSError:
            pass
