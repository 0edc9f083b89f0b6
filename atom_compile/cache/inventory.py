"""What is in a cache root, without torch: enumerate caches, read their index files, size them.

Everything here reads the layout that `store.py` writes::

    <root>/torch_compile_cache/<hash>/cache_key_factors.json
    <root>/torch_compile_cache/<hash>/last_used               (mtime: the last warm start)
    <root>/torch_compile_cache/<hash>/.in_use                 (shared flock held by users)
    <root>/torch_compile_cache/<hash>/rank_<r>/<prefix>/index.json, artifacts/*.bin, ...
    <root>/torch_compile_cache/<hash>/rank_<r>/<prefix>/inductor/   (Inductor's own files)
    <root>/torch_compile_cache/entrypoints/<key>.json         ({"hash": ..., ...})

Nothing is executed or unpickled: indexes and factors are JSON, artifacts are only hashed
(verify.py). Removal is removal.py, export and import archive.py.

Two sizes are kept apart because users compare them: `cache_bytes`, what the index and its
digests cover (artifacts, saved Dynamo functions, index and factor files: what an export
ships), and `scratch_bytes`, Inductor's own files for the pieces (generated C++ and its
libraries), which no digest covers and which a start rebuilds when they are missing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from ..errors import AtomCompileError
from . import run_stats, trust
from .scratch import SCRATCH_DIR
from .store import (
    FACTORS_FILE,
    HASH_RE,
    INDEX_FILE,
    LAST_USED_FILE,
    IndexInvalid,
    caches_dir,
    hash_dir,
    parse_index,
)

ENTRYPOINTS = "entrypoints"  # the same name as aot.ENTRYPOINTS (aot imports torch)
_RANK_RE = re.compile(r"^rank_(\d+)$")
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
ENTRYPOINT_RE = re.compile(r"^[A-Za-z0-9_-]+\.json$")
_HASH_PREFIX_RE = re.compile(r"^[0-9a-f]{4,16}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


class InventoryError(AtomCompileError):
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


def _shape_order(shape: Any) -> tuple:
    if isinstance(shape, int):
        return (0, shape, "")
    lo = str(shape).split("-")[0]
    return (1, int(lo) if lo.isdigit() else 0, str(shape))


@dataclass
class PieceDir:
    """One `rank_<r>/<prefix>/` directory and its index (None if absent or unusable)."""

    rank: int
    prefix: str
    path: Path
    root: Path  # the directory the trust checks start from (the cache root, or import staging)
    index: Optional[dict] = None
    problem: Optional[str] = None  # why an existing index cannot be used
    run_stats: Optional[dict] = None  # the last run's compiles after warm-up (run_stats.py)

    @property
    def entries(self) -> list[dict]:
        return list((self.index or {}).get("entries", []))

    @property
    def dynamo_function(self) -> Optional[dict]:
        return (self.index or {}).get("dynamo_function")

    @property
    def artifact_paths(self) -> list[str]:
        """The distinct artifact files of the index (deduplicated pieces share one)."""
        return sorted({e["handle"]["path"] for e in self.entries})

    @property
    def inductor_files(self) -> dict[str, str]:
        """The manifest: Inductor's own files for these pieces and their sha256."""
        return dict((self.index or {}).get("inductor_files") or {})

    @property
    def has_scratch(self) -> bool:
        """Whether Inductor's own files for these pieces are here (a start rebuilds them if not)."""
        return (self.path / SCRATCH_DIR).is_dir()


@dataclass
class CacheInfo:
    """One `<hash>/` directory: where it is, how big, when used, and what it holds."""

    hash: str
    path: Path
    bytes: int = 0  # everything on disk: cache_bytes + scratch_bytes
    files: int = 0
    scratch_bytes: int = 0  # Inductor's own files (rank_<r>/<prefix>/inductor/)
    scratch_files: int = 0
    factors: Optional[dict] = None
    factors_problem: Optional[str] = None
    pieces: list[PieceDir] = field(default_factory=list)
    created: Optional[float] = None
    last_used: Optional[float] = None
    trust: list[str] = field(default_factory=list)  # why atom-compile would refuse parts of it
    # prefix -> artifact names compiled once and shared by the ranks (<hash>/shared/<prefix>/)
    shared: dict[str, set[str]] = field(default_factory=dict)

    @property
    def entries(self) -> list[dict]:
        return [e for p in self.pieces for e in p.entries]

    @property
    def artifacts(self) -> int:
        """Distinct compiled-piece artifacts (what verify checks, besides Dynamo functions)."""
        return sum(len(p.artifact_paths) for p in self.pieces)

    @property
    def dynamo_functions(self) -> int:
        return sum(1 for p in self.pieces if p.dynamo_function)

    @property
    def cache_bytes(self) -> int:
        """What the index covers: artifacts, Dynamo functions, index and factor files."""
        return self.bytes - self.scratch_bytes

    @property
    def prefixes(self) -> list[str]:
        return sorted({p.prefix for p in self.pieces})

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.pieces})

    @property
    def shapes(self) -> list[Optional[Union[int, str]]]:
        """Runtime shapes with an entry: None (the general shape) first, then compile sizes
        ascending, then compile ranges ("lo-hi") by their low end."""
        found = {e.get("runtime_shape") for e in self.entries}
        return ([None] if None in found else []) + sorted((s for s in found if s is not None), key=_shape_order)

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
        out.extend(f"untrusted: {t}" for t in self.trust)
        return out


def read_json(root: Path, path: Path) -> tuple[Optional[Any], Optional[str]]:
    """(document, None) or (None, why not); (None, None) if the file does not exist. Read
    through the trust checks from `root` down, size and nesting bounded."""
    try:
        text = trust.read_bytes(root, path, trust.MAX_JSON_BYTES).decode()
    except FileNotFoundError:
        return None, None
    except trust.Untrusted as exc:
        if not os.path.lexists(path) and "missing" in exc.reason:
            return None, None
        return None, f"untrusted: {exc.reason}"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read it ({getattr(exc, 'strerror', None) or exc})"
    try:
        return trust.loads_bounded(text), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at line {exc.lineno})"
    except ValueError as exc:
        return None, f"refused before parsing: {exc}"


def _read_piece(root: Path, rank: int, prefix: str, path: Path) -> PieceDir:
    piece = PieceDir(rank, prefix, path, root, run_stats=run_stats.read(root, path))
    try:
        text = trust.read_bytes(root, path / INDEX_FILE, trust.MAX_JSON_BYTES).decode()
    except FileNotFoundError:
        return piece
    except trust.Untrusted as exc:
        piece.problem = f"untrusted: {exc.reason}"
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


def piece_dirs(root: Path, cache_path: Path) -> list[PieceDir]:
    """Every `rank_<r>/<prefix>/` of a cache, its index read through the trust checks."""
    pieces = []
    for rank_entry in _subdirs(cache_path):
        match = _RANK_RE.match(rank_entry.name)
        if not match:
            continue
        for prefix_entry in _subdirs(Path(rank_entry.path)):
            if PREFIX_RE.match(prefix_entry.name):
                pieces.append(_read_piece(root, int(match.group(1)), prefix_entry.name, Path(prefix_entry.path)))
    return sorted(pieces, key=lambda p: (p.rank, p.prefix))


def shared_artifacts(cache_path: Path) -> dict[str, set[str]]:
    """prefix -> the artifact file names in `<hash>/shared/<prefix>/artifacts/`."""
    out = {}
    for prefix_entry in _subdirs(cache_path / "shared"):
        if PREFIX_RE.match(prefix_entry.name):
            try:
                out[prefix_entry.name] = {e.name for e in os.scandir(Path(prefix_entry.path) / "artifacts")
                                          if e.is_file(follow_symlinks=False) and not e.name.startswith(".")}
            except OSError:
                continue
    return out


def disk_usage(path: Path) -> tuple[int, int]:
    """(bytes, files) of the regular files under `path`; links are not followed, and a file
    hard-linked several times (a piece shared by ranks) counts once."""
    total = count = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        try:
                            st = entry.stat(follow_symlinks=False)
                            if st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
                                continue
                            seen.add((st.st_dev, st.st_ino))
                            total += st.st_size
                            count += 1
                        except OSError:
                            pass
        except OSError:
            continue
    return total, count


def _scratch_usage(pieces: list[PieceDir]) -> tuple[int, int]:
    sizes = [disk_usage(p.path / SCRATCH_DIR) for p in pieces]
    return sum(b for b, _ in sizes), sum(n for _, n in sizes)


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
    info.trust = trust.tree_problems(root, path, limit=10)
    if os.path.islink(path):  # never read through it
        return info
    info.bytes, info.files = disk_usage(path)
    factors, info.factors_problem = read_json(root, path / FACTORS_FILE)
    if factors is not None and not isinstance(factors, dict):
        factors, info.factors_problem = None, "not a JSON object"
    info.factors = factors
    info.pieces = piece_dirs(root, path)
    info.shared = shared_artifacts(path)
    info.scratch_bytes, info.scratch_files = _scratch_usage(info.pieces)
    created = [p.index["created"] for p in info.pieces if p.index and isinstance(p.index.get("created"), (int, float))]
    updated = [p.index["updated"] for p in info.pieces if p.index and isinstance(p.index.get("updated"), (int, float))]
    info.created = min(created) if created else _mtime(path / FACTORS_FILE) or _mtime(path)
    # last_used is touched by a warm start; a cold compile only leaves the index's "updated".
    used = [t for t in [_mtime(path / LAST_USED_FILE), *updated] if t is not None]
    info.last_used = max(used) if used else info.created
    return info


def cache_hashes(root: Path) -> list[str]:
    """The hashes of the caches under `root` (directories named by 16 hex digits)."""
    try:
        with os.scandir(caches_dir(root)) as it:
            names = [e.name for e in it if HASH_RE.match(e.name) and (e.is_dir() or e.is_symlink())]
    except OSError:
        return []
    return sorted(names)


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
        if not ENTRYPOINT_RE.match(name):
            continue
        doc, problem = read_json(root, directory / name)
        cache_hash = doc.get("hash") if isinstance(doc, dict) else None
        if problem is None and not (isinstance(cache_hash, str) and HASH_RE.match(cache_hash)):
            problem, cache_hash = "no cache hash in it", None
        out.append(EntryPoint(directory / name, cache_hash, problem))
    return out



# --- sizes -------------------------------------------------------------------------------


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
