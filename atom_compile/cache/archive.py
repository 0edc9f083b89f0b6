"""Export one cache to a .tar.gz, and import such an archive, all or nothing.

Import checks every member before writing a byte, extracts into a temp dir inside the root,
checks every artifact against its index, then renames each cache into place. Inductor's own
files (`inductor/` beside each index) never travel: no digest covers them.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

from .inventory import (
    ENTRYPOINT_RE,
    ENTRYPOINTS,
    SCRATCH_DIR,
    ArchiveError,
    BadArgument,
    piece_dirs,
    read_json,
    entrypoints,
    read_cache,
)
from .store import CACHE_SUBDIR, FACTORS_FILE, HASH_RE, IN_USE_FILE, LAST_USED_FILE, caches_dir, trust_problem
from .verify import verify_cache, verify_piece

# Files a process keeps for itself; they never travel in an export.
_LOCAL_FILES = {IN_USE_FILE, LAST_USED_FILE, ".index.lock"}

def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members carry no owner and plain modes: the importer owns what it places."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def export_cache(root: Path, cache_hash: str, output: Path) -> dict:
    """Write `<hash>/` and the entry points that name it to a .tar.gz, atomically.

    The cache is verified first: shipping damage would only move the problem elsewhere.
    Returns {"hash", "output", "bytes" (the archive), "files", "entrypoints", "artifacts",
    "dynamo_functions", "cache_bytes" (what went in, uncompressed), "scratch_bytes" (left out)}.
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
            "entrypoints": len(points), "artifacts": info.artifacts, "dynamo_functions": info.dynamo_functions,
            "cache_bytes": info.cache_bytes, "scratch_bytes": info.scratch_bytes}




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
        if len(rest) == 2 and member.isfile() and ENTRYPOINT_RE.match(rest[1]):
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
    pieces = piece_dirs(staged)
    indexed = [p for p in pieces if p.index is not None or p.problem]
    if not indexed:
        raise ArchiveError(f"the archive's cache {cache_hash} has no index.json; refusing it")
    for piece in indexed:
        damage = verify_piece(piece)
        if damage:
            rel = damage[0].path.relative_to(staged).as_posix()
            raise ArchiveError(f"the archive's cache {cache_hash} is damaged ({rel}: {damage[0].reason}); "
                               "nothing was imported")
    factors, problem = read_json(staged / FACTORS_FILE)
    if problem or (factors is not None and not isinstance(factors, dict)):
        raise ArchiveError(f"the archive's {cache_hash}/{FACTORS_FILE} is unusable ({problem or 'not an object'})")


def _check_entrypoint(path: Path, hashes: set[str]) -> None:
    doc, problem = read_json(path)
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
