"""What is in a cache root, without torch: enumerate, size, verify, remove, export, import.

The CLI's torch-free half. Everything here reads the layout that `store.py` writes::

    <root>/torch_compile_cache/<hash>/cache_key_factors.json
    <root>/torch_compile_cache/<hash>/last_used               (mtime: the last warm start)
    <root>/torch_compile_cache/<hash>/.in_use                 (shared flock held by users)
    <root>/torch_compile_cache/<hash>/rank_<r>/<prefix>/index.json, artifacts/*.bin, ...
    <root>/torch_compile_cache/entrypoints/<key>.json         ({"hash": ..., ...})

Nothing is executed or unpickled: indexes and factors are JSON, artifacts are only hashed.
Removal takes the cache's `.in_use` flock exclusively (failing at once if any process holds
it shared) and every index lock of the cache, so no reader or writer sees half a cache.
Import extracts into a temp dir inside the root, checks every digest, then renames.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Optional

import filelock

from .store import (
    CACHE_SUBDIR,
    FACTORS_FILE,
    HASH_RE,
    IN_USE_FILE,
    INDEX_FILE,
    LAST_USED_FILE,
    IndexInvalid,
    digest_problem,
    caches_dir,
    hash_dir,
    parse_index,
    trust_problem,
)

ENTRYPOINTS = "entrypoints"  # the same name as aot.ENTRYPOINTS (aot imports torch)
_RANK_RE = re.compile(r"^rank_(\d+)$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z0-9_-]+\.json$")
_HASH_PREFIX_RE = re.compile(r"^[0-9a-f]{4,16}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
# Files a process keeps for itself; they never travel in an export.
_LOCAL_FILES = {IN_USE_FILE, LAST_USED_FILE, ".index.lock"}


class InventoryError(Exception):
    """A failure the CLI reports as one line; `exit_code` 1 is damage or a miss, 2 bad input."""

    exit_code = 1


class BadArgument(InventoryError, ValueError):
    """A malformed argument (a hash that is not hex, a size that is not a size)."""

    exit_code = 2


class CacheNotFound(InventoryError, LookupError):
    """No cache of that hash under the root."""


class ArchiveError(InventoryError, ValueError):
    """An archive that cannot be read, or that import refuses (unsafe member, bad digest)."""


# --- reading one cache ---------------------------------------------------------------------


@dataclass
class PieceDir:
    """One `rank_<r>/<prefix>/` directory and its index (None if absent or unusable)."""

    rank: int
    prefix: str
    path: Path
    index: Optional[dict] = None
    problem: Optional[str] = None  # why an existing index cannot be used

    @property
    def entries(self) -> list[dict]:
        return list((self.index or {}).get("entries", []))

    @property
    def dynamo_function(self) -> Optional[dict]:
        return (self.index or {}).get("dynamo_function")


@dataclass
class CacheInfo:
    """One `<hash>/` directory: where it is, how big, when used, and what it holds."""

    hash: str
    path: Path
    bytes: int = 0
    files: int = 0
    factors: Optional[dict] = None
    factors_problem: Optional[str] = None
    pieces: list[PieceDir] = field(default_factory=list)
    created: Optional[float] = None
    last_used: Optional[float] = None
    trust: Optional[str] = None  # why atom-compile would refuse to use it

    @property
    def entries(self) -> list[dict]:
        return [e for p in self.pieces for e in p.entries]

    @property
    def prefixes(self) -> list[str]:
        return sorted({p.prefix for p in self.pieces})

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.pieces})

    @property
    def shapes(self) -> list[Optional[int]]:
        """Runtime shapes with an entry: None (the general shape) first, then sizes ascending."""
        found = {e.get("runtime_shape") for e in self.entries}
        return ([None] if None in found else []) + sorted(s for s in found if s is not None)

    @property
    def torch_version(self) -> Optional[str]:
        for p in self.pieces:
            if p.index and p.index.get("torch_version"):
                return p.index["torch_version"]
        return ((self.factors or {}).get("environment") or {}).get("torch")

    @property
    def problems(self) -> list[str]:
        out = [f"{p.path.relative_to(self.path)}/{INDEX_FILE}: {p.problem}" for p in self.pieces if p.problem]
        if self.factors_problem:
            out.append(f"{FACTORS_FILE}: {self.factors_problem}")
        if self.trust:
            out.append(f"refused by atom-compile: {self.trust}")
        return out


def _read_json(path: Path) -> tuple[Optional[Any], Optional[str]]:
    """(document, None) or (None, why not); (None, None) if the file does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read it ({getattr(exc, 'strerror', None) or exc})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at line {exc.lineno})"


def _read_piece(rank: int, prefix: str, path: Path) -> PieceDir:
    piece = PieceDir(rank, prefix, path)
    try:
        text = (path / INDEX_FILE).read_text()
    except FileNotFoundError:
        return piece
    except (OSError, UnicodeDecodeError) as exc:
        piece.problem = f"cannot read it ({getattr(exc, 'strerror', None) or exc})"
        return piece
    try:
        piece.index = parse_index(text)
    except IndexInvalid as exc:
        piece.problem = str(exc)
    return piece


def _subdirs(path: Path) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    yield entry
    except OSError:
        return


def _piece_dirs(cache_path: Path) -> list[PieceDir]:
    pieces = []
    for rank_entry in _subdirs(cache_path):
        match = _RANK_RE.match(rank_entry.name)
        if not match:
            continue
        for prefix_entry in _subdirs(Path(rank_entry.path)):
            if _PREFIX_RE.match(prefix_entry.name):
                pieces.append(_read_piece(int(match.group(1)), prefix_entry.name, Path(prefix_entry.path)))
    return sorted(pieces, key=lambda p: (p.rank, p.prefix))


def disk_usage(path: Path) -> tuple[int, int]:
    """(bytes, files) of the regular files under `path`; links are not followed."""
    total = count = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        try:
                            total += entry.stat(follow_symlinks=False).st_size
                            count += 1
                        except OSError:
                            pass
        except OSError:
            continue
    return total, count


def _mtime(path: Path) -> Optional[float]:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def read_cache(root: Path, cache_hash: str) -> CacheInfo:
    """Everything about one cache; CacheNotFound if `<root>/torch_compile_cache/<hash>` is absent."""
    path = hash_dir(root, cache_hash)
    if not path.is_dir():
        raise CacheNotFound(f"no cache {cache_hash} under {caches_dir(root)}")
    info = CacheInfo(cache_hash, path)
    info.bytes, info.files = disk_usage(path)
    factors, info.factors_problem = _read_json(path / FACTORS_FILE)
    if factors is not None and not isinstance(factors, dict):
        factors, info.factors_problem = None, "not a JSON object"
    info.factors = factors
    info.pieces = _piece_dirs(path)
    info.trust = next((p for p in (trust_problem(d) for d in (caches_dir(root), path)) if p), None)
    created = [p.index["created"] for p in info.pieces if p.index and isinstance(p.index.get("created"), (int, float))]
    updated = [p.index["updated"] for p in info.pieces if p.index and isinstance(p.index.get("updated"), (int, float))]
    info.created = min(created) if created else _mtime(path / FACTORS_FILE) or _mtime(path)
    # last_used is touched by a warm start; a cold compile only leaves the index's "updated".
    used = [t for t in [_mtime(path / LAST_USED_FILE), *updated] if t is not None]
    info.last_used = max(used) if used else info.created
    return info


def cache_hashes(root: Path) -> list[str]:
    """The hashes of the caches under `root` (directories named by 16 hex digits)."""
    return sorted(e.name for e in _subdirs(caches_dir(root)) if HASH_RE.match(e.name))


def list_caches(root: Path) -> list[CacheInfo]:
    """Every cache under `root`, most recently used first."""
    infos = []
    for cache_hash in cache_hashes(root):
        try:
            infos.append(read_cache(root, cache_hash))
        except CacheNotFound:  # removed while we listed
            continue
    return sorted(infos, key=lambda c: -(c.last_used or 0.0))


def resolve_hash(root: Path, text: str) -> str:
    """A full hash from a full one or a unique prefix (at least 4 hex digits), as git does."""
    value = text.strip().lower()
    if not _HASH_PREFIX_RE.match(value):
        raise BadArgument(f"cache hash: got {text!r}; allowed: 16 hex digits (or a unique prefix of 4 or more)")
    if HASH_RE.match(value):
        if not hash_dir(root, value).is_dir():
            raise CacheNotFound(f"no cache {value} under {caches_dir(root)}")
        return value
    matches = [h for h in cache_hashes(root) if h.startswith(value)]
    if not matches:
        raise CacheNotFound(f"no cache {value}... under {caches_dir(root)}")
    if len(matches) > 1:
        raise BadArgument(f"cache hash: {value!r} names {len(matches)} caches ({', '.join(matches[:4])}); give more digits")
    return matches[0]


# --- entry points --------------------------------------------------------------------------


@dataclass
class EntryPoint:
    """`entrypoints/<key>.json`: a warm start that skips Dynamo loads `hash` (None: unreadable)."""

    path: Path
    hash: Optional[str]
    problem: Optional[str] = None


def entrypoints(root: Path) -> list[EntryPoint]:
    out = []
    directory = caches_dir(root) / ENTRYPOINTS
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not _ENTRYPOINT_RE.match(name):
            continue
        doc, problem = _read_json(directory / name)
        cache_hash = doc.get("hash") if isinstance(doc, dict) else None
        if problem is None and not (isinstance(cache_hash, str) and HASH_RE.match(cache_hash)):
            problem, cache_hash = "no cache hash in it", None
        out.append(EntryPoint(directory / name, cache_hash, problem))
    return out


# --- verify --------------------------------------------------------------------------------


@dataclass
class Damage:
    path: Path
    reason: str


def _inside(base: Path, rel: str) -> Optional[Path]:
    """`base/rel` if `rel` stays inside `base` (parse_index checked it; belt and braces)."""
    if os.path.isabs(rel) or ".." in PurePosixPath(rel).parts:
        return None
    return base / rel


def verify_piece(piece: PieceDir) -> list[Damage]:
    """Every artifact (and the Dynamo function) of one index against its recorded sha256."""
    if piece.problem:
        return [Damage(piece.path / INDEX_FILE, piece.problem)]
    records = [(e["handle"]["path"], e["sha256"]) for e in piece.entries]
    if piece.dynamo_function:
        records.append((piece.dynamo_function["path"], piece.dynamo_function["sha256"]))
    damage, seen = [], set()
    for rel, sha256 in records:
        if rel in seen:  # deduplicated pieces share one artifact
            continue
        seen.add(rel)
        path = _inside(piece.path, rel)
        reason = "path outside the cache" if path is None else digest_problem(path, sha256)
        if reason is not None:
            damage.append(Damage(path or piece.path / rel, reason))
    return damage


def verify_cache(info: CacheInfo) -> list[Damage]:
    """All damage in one cache: unusable indexes or factors, artifacts that fail their digest."""
    damage = [d for p in info.pieces for d in verify_piece(p)]
    if info.factors_problem:
        damage.append(Damage(info.path / FACTORS_FILE, info.factors_problem))
    if info.trust:
        damage.append(Damage(info.path, f"atom-compile refuses it: {info.trust}"))
    return damage


def verified_files(info: CacheInfo) -> int:
    """How many files verify_cache hashes (for the report)."""
    return sum(len({e["handle"]["path"] for e in p.entries}) + (1 if p.dynamo_function else 0)
               for p in info.pieces if not p.problem)


# --- remove --------------------------------------------------------------------------------


@dataclass
class Removal:
    hash: str
    bytes: int
    removed: bool
    reason: Optional[str] = None  # why it was kept


def _try_exclusive(path: Path) -> Optional[int]:
    """An fd holding an exclusive flock on `path`, or None if a process holds it (shared)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
    shutil.rmtree(doomed, ignore_errors=True)
    return Removal(info.hash, info.bytes, True)


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
                ep.path.unlink()
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


def parse_size(text: str) -> int:
    """'2G', '500M', '1.5GiB', '4096' -> bytes (binary units: 1K = 1024)."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise BadArgument(f"size: got {text!r}; allowed: a number with an optional unit K, M, G, T (e.g. 2G, 500M)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGTP".index(unit or " "))


def format_size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- export / import -----------------------------------------------------------------------


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members carry no owner and plain modes: the importer owns what it places."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def export_cache(root: Path, cache_hash: str, output: Path) -> dict:
    """Write `<hash>/` and the entry points that name it to a .tar.gz, atomically.

    The cache is verified first: shipping damage would only move the problem elsewhere.
    Returns {"hash", "output", "bytes", "files", "entrypoints"}.
    """
    info = read_cache(root, cache_hash)
    damage = verify_cache(info)
    if damage:
        raise ArchiveError(f"cache {cache_hash} is damaged ({damage[0].path}: {damage[0].reason}); "
                           "run `atom-compile-cache verify` and clear it instead of exporting it")
    if not any(p.index for p in info.pieces):
        raise ArchiveError(f"cache {cache_hash} has no index (nothing compiled into it yet)")
    points = [ep for ep in entrypoints(root) if ep.hash == cache_hash]
    output = Path(output)
    out_dir = output.parent if str(output.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".tar.gz", dir=str(out_dir))
    except OSError as exc:
        raise BadArgument(f"cannot write {output}: {exc.strerror or exc}") from None
    files = 0
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            base = f"{CACHE_SUBDIR}/{cache_hash}"
            tar.add(str(info.path), arcname=base, recursive=False, filter=_normalised)
            for path in _exported_files(info.path):
                rel = path.relative_to(info.path).as_posix()
                tar.add(str(path), arcname=f"{base}/{rel}", recursive=False, filter=_normalised)
                files += 1
            for ep in points:
                tar.add(str(ep.path), arcname=f"{CACHE_SUBDIR}/{ENTRYPOINTS}/{ep.path.name}", filter=_normalised)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise ArchiveError(f"cannot write {output}: {exc.strerror or exc}") from None
        raise
    return {"hash": cache_hash, "output": str(output), "bytes": output.stat().st_size, "files": files,
            "entrypoints": len(points)}


# Inductor's own files for the pieces (CPU libraries, generated code): no digest covers them,
# so they never travel; an imported cache rebuilds them on its first start.
SCRATCH_DIR = "inductor"


def _exported_files(cache_path: Path) -> list[Path]:
    """Regular files and directories of a cache, without process-local, temp and scratch files."""
    out = []
    for dirpath, dirnames, filenames in os.walk(cache_path):
        here = Path(dirpath)
        in_piece_dir = len(here.relative_to(cache_path).parts) == 2  # rank_<r>/<prefix>
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (in_piece_dir and d == SCRATCH_DIR))
        if here != cache_path:
            out.append(here)
        for name in sorted(filenames):
            path = here / name
            if name in _LOCAL_FILES or name.startswith(".") or path.is_symlink() or not path.is_file():
                continue
            out.append(path)
    return out


def _member_target(member: tarfile.TarInfo) -> tuple[str, PurePosixPath]:
    """('cache', <hash>/<rel>) or ('entrypoint', <name>) for an acceptable member; else ArchiveError."""
    name = member.name
    pure = PurePosixPath(name)
    if name.startswith("/") or "\\" in name or any(part in ("..", "") for part in name.rstrip("/").split("/")):
        raise ArchiveError(f"archive member {name!r} escapes the cache root; refusing the archive")
    if not (member.isfile() or member.isdir()):
        kind = "a link" if (member.issym() or member.islnk()) else "a device or special file"
        raise ArchiveError(f"archive member {name!r} is {kind}; refusing the archive")
    parts = pure.parts
    if parts[0] != CACHE_SUBDIR:
        raise ArchiveError(f"archive member {name!r} is not under {CACHE_SUBDIR}/; refusing the archive")
    rest = parts[1:]
    if not rest:
        return "root", PurePosixPath(".")
    if rest[0] == ENTRYPOINTS:
        if len(rest) == 1 and member.isdir():
            return "root", PurePosixPath(".")
        if len(rest) == 2 and member.isfile() and _ENTRYPOINT_RE.match(rest[1]):
            return "entrypoint", PurePosixPath(rest[1])
        raise ArchiveError(f"archive member {name!r} is not an entry point file; refusing the archive")
    if not HASH_RE.match(rest[0]):
        raise ArchiveError(f"archive member {name!r} is not inside a cache <hash>/ directory; refusing the archive")
    if len(rest) >= 4 and rest[3] == SCRATCH_DIR:  # <hash>/rank_<r>/<prefix>/inductor
        raise ArchiveError(f"archive member {name!r} is compiler scratch that no digest covers; refusing the archive")
    return "cache", PurePosixPath(*rest)


def _open_archive(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(str(path), mode="r:*")
    except FileNotFoundError:
        raise BadArgument(f"no such file: {path}") from None
    except IsADirectoryError:
        raise BadArgument(f"{path} is a directory, not an archive") from None
    except PermissionError as exc:
        raise BadArgument(f"cannot read {path}: {exc.strerror}") from None
    except tarfile.ReadError:
        raise ArchiveError(f"{path} is not a .tar.gz archive (nor any tar archive Python reads)") from None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ArchiveError(f"{path} is not a readable .tar.gz archive ({exc})") from None


def _extract(tar: tarfile.TarFile, staging: Path) -> tuple[set[str], list[str]]:
    """Write every checked member under `staging` (no links, nothing outside it).
    Returns (hashes, entry point names)."""
    hashes: set[str] = set()
    points: list[str] = []
    members = tar.getmembers()
    for member in members:
        kind, rel = _member_target(member)
        if kind == "root":
            continue
        if kind == "entrypoint":
            target = staging / ENTRYPOINTS / rel
            points.append(rel.name)
        else:
            hashes.add(rel.parts[0])
            target = staging / "caches" / rel
        if member.isdir():
            target.mkdir(mode=0o755, parents=True, exist_ok=True)
            continue
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        source = tar.extractfile(member)
        if source is None:
            raise ArchiveError(f"archive member {member.name!r} has no data; refusing the archive")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(target, flags, 0o644)
        except FileExistsError:
            raise ArchiveError(f"archive member {member.name!r} appears twice; refusing the archive") from None
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    return hashes, points


def _check_staged(staged: Path, cache_hash: str) -> None:
    """A staged cache must have at least one valid index, and every digest must match."""
    pieces = _piece_dirs(staged)
    indexed = [p for p in pieces if p.index is not None or p.problem]
    if not indexed:
        raise ArchiveError(f"the archive's cache {cache_hash} has no index.json; refusing it")
    for piece in indexed:
        damage = verify_piece(piece)
        if damage:
            rel = damage[0].path.relative_to(staged).as_posix()
            raise ArchiveError(f"the archive's cache {cache_hash} is damaged ({rel}: {damage[0].reason}); "
                               "nothing was imported")
    factors, problem = _read_json(staged / FACTORS_FILE)
    if problem or (factors is not None and not isinstance(factors, dict)):
        raise ArchiveError(f"the archive's {cache_hash}/{FACTORS_FILE} is unusable ({problem or 'not an object'})")


def _check_entrypoint(path: Path, hashes: set[str]) -> None:
    doc, problem = _read_json(path)
    if problem or not isinstance(doc, dict) or doc.get("hash") not in hashes:
        raise ArchiveError(f"the archive's entry point {path.name} does not name a cache in the archive; refusing it")


def _mkdir_owned(path: Path) -> None:
    """Create `path` (and parents) 0755, as store.py would, and refuse one we must not trust."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    problem = trust_problem(path)
    if problem:
        raise ArchiveError(f"not importing into {path}: {problem}")


def import_archive(root: Path, archive: Path) -> dict:
    """Place the caches of an exported archive under `root`, all or nothing.

    Every member is checked before anything is written (relative, under
    `torch_compile_cache/<hash>/` or `entrypoints/`, a regular file or directory), then the
    archive is extracted into a temp dir inside the root, every artifact is checked against its
    index, and each cache is renamed into place. A cache already present is left as it is.
    Returns {"imported": [hashes], "present": [hashes], "entrypoints": n}.
    """
    root = Path(root)
    with _open_archive(archive) as tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise ArchiveError(f"{archive} is not a readable .tar.gz archive ({exc})") from None
        for member in members:
            _member_target(member)  # refuse before writing a single byte
        caches = caches_dir(root)
        _mkdir_owned(caches)
        staging = Path(tempfile.mkdtemp(prefix=".import-", dir=str(caches)))
        try:
            try:
                hashes, points = _extract(tar, staging)
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise ArchiveError(f"{archive} is truncated or damaged ({exc}); nothing was imported") from None
            return _place(caches, staging, hashes, points)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _place(caches: Path, staging: Path, hashes: set[str], points: list[str]) -> dict:
    if not hashes:
        raise ArchiveError("the archive holds no cache (no torch_compile_cache/<hash>/ directory)")
    for cache_hash in sorted(hashes):
        _check_staged(staging / "caches" / cache_hash, cache_hash)
    for name in points:
        _check_entrypoint(staging / ENTRYPOINTS / name, hashes)
    imported, present = [], []
    for cache_hash in sorted(hashes):
        source, target = staging / "caches" / cache_hash, caches / cache_hash
        for dirpath, _, _ in os.walk(source):
            os.chmod(dirpath, 0o755)
        if target.exists():
            present.append(cache_hash)
            continue
        try:
            os.rename(source, target)  # atomic: the cache appears whole or not at all
        except OSError:
            if target.exists():  # another import won the race
                present.append(cache_hash)
                continue
            raise
        imported.append(cache_hash)
    if points:
        _mkdir_owned(caches / ENTRYPOINTS)
    for name in points:
        os.replace(staging / ENTRYPOINTS / name, caches / ENTRYPOINTS / name)
    return {"imported": imported, "present": present, "entrypoints": len(points)}
