"""Export one cache to a .tar.gz, and import such an archive, all or nothing.

Export ships what the indexes name: each index, its artifacts and Dynamo function, the
Inductor files its manifest covers (so an import warm-starts with no compiler run), the key
factors and the entry points. Import checks every member and the expanded size before writing
a byte, extracts into a private temp dir inside the root, checks every named file against its
digest, assembles a new cache of only those files (private modes), and renames it into place.
A cache or entry point already present is never touched.
"""

from __future__ import annotations

import os
import shutil
import stat
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
from . import trust
from .store import CACHE_SUBDIR, FACTORS_FILE, HASH_RE, INDEX_FILE, caches_dir
from .verify import verify_cache, verify_piece

MAX_IMPORT_BYTES = 8 << 30  # the most an archive may expand to

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
    "dynamo_functions", "cache_bytes" (what went in, uncompressed, Inductor files aside),
    "scratch_bytes" (Inductor's files), "scratch_shipped" (their part that went in)}.
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
            shipped = _named_files(info)
            for path in _with_parents(info.path, shipped):
                rel = path.relative_to(info.path).as_posix()
                _add_member(tar, path, f"{base}/{rel}")
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
            "cache_bytes": info.cache_bytes, "scratch_bytes": info.scratch_bytes,
            "scratch_shipped": sum(os.lstat(p).st_size for p in shipped if SCRATCH_DIR in p.relative_to(info.path).parts)}




def _add_member(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    """Add a file or directory. A piece shared by ranks is one file hard-linked into each rank's
    directory; tarfile would store the second name as a link, which import refuses, so every
    name goes in as a regular file (import links them back: `_relink_shared`)."""
    info = _normalised(tar.gettarinfo(str(path), arcname))
    if info.islnk():
        info.type, info.linkname, info.size = tarfile.REGTYPE, "", os.lstat(path).st_size
    if info.isfile():
        with open(path, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def _relink_shared(clean: Path) -> None:
    """Artifacts with equal names (their digest) in several ranks' directories: one inode."""
    first: dict[str, Path] = {}
    for path in sorted(clean.glob("rank_*/*/artifacts/*")):
        if path.name not in first:
            first[path.name] = path
            continue
        tmp = path.with_name(f".link-{path.name}")
        os.link(first[path.name], tmp)
        os.replace(tmp, path)


def _named_files(info) -> list[Path]:
    """The files of a cache that its indexes name (index, artifacts, Dynamo function, the
    Inductor files of the manifest) and its key factors: what an export ships."""
    out = [info.path / FACTORS_FILE] if (info.path / FACTORS_FILE).is_file() else []
    for piece in info.pieces:
        if piece.index is None:
            continue
        out.append(piece.path / INDEX_FILE)
        out += [piece.path / rel for rel in piece.artifact_paths]
        if piece.dynamo_function:
            out.append(piece.path / piece.dynamo_function["path"])
        out += [piece.path / SCRATCH_DIR / rel for rel in sorted(piece.inductor_files)]
    return sorted(set(out))


def _with_parents(base: Path, files: list[Path]) -> list[Path]:
    """`files` preceded by every directory between `base` and them, parents first."""
    dirs = {parent for f in files for parent in f.relative_to(base).parents if str(parent) != "."}
    return sorted((base / d for d in dirs), key=lambda p: len(p.parts)) + files


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
    """Write every checked member under `staging` (no links, nothing outside it, private modes).
    Returns (hashes, entry point names)."""
    hashes: set[str] = set()
    points: list[str] = []
    for member in tar.getmembers():
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
            trust.make_private_dirs(staging, target)
            continue
        trust.make_private_dirs(staging, target.parent)
        source = tar.extractfile(member)
        if source is None:
            raise ArchiveError(f"archive member {member.name!r} has no data; refusing the archive")
        _write_new(target, lambda out: shutil.copyfileobj(source, out, 1 << 20), member.name)
    return hashes, points


def _write_new(target: Path, write, what: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target, flags, trust.FILE_MODE)
    except FileExistsError:
        raise ArchiveError(f"archive member {what!r} appears twice; refusing the archive") from None
    with os.fdopen(fd, "wb") as out:
        write(out)


def _check_staged(staging: Path, staged: Path, cache_hash: str) -> list:
    """The staged cache's usable pieces; ArchiveError unless it has an index and every digest
    (artifacts, Dynamo functions, the Inductor files of each manifest) matches."""
    pieces = piece_dirs(staging, staged)
    indexed = [p for p in pieces if p.index is not None or p.problem]
    if not indexed:
        raise ArchiveError(f"the archive's cache {cache_hash} has no index.json; refusing it")
    for piece in indexed:
        damage = verify_piece(piece)
        if damage:
            rel = damage[0].path.relative_to(staged).as_posix()
            raise ArchiveError(f"the archive's cache {cache_hash} is damaged ({rel}: {damage[0].reason}); "
                               "nothing was imported")
    factors, problem = read_json(staging, staged / FACTORS_FILE)
    if problem or (factors is not None and not isinstance(factors, dict)):
        raise ArchiveError(f"the archive's {cache_hash}/{FACTORS_FILE} is unusable ({problem or 'not an object'})")
    return indexed


def _check_entrypoint(staging: Path, path: Path, hashes: set[str]) -> None:
    doc, problem = read_json(staging, path)
    if problem or not isinstance(doc, dict) or doc.get("hash") not in hashes:
        raise ArchiveError(f"the archive's entry point {path.name} does not name a cache in the archive; refusing it")


def _mkdir_owned(root: Path, path: Path) -> None:
    """Create `path` (and the directories from `root` down) private, as store.py would, and
    refuse one we must not trust."""
    try:
        trust.make_private_dirs(root, path)
    except OSError as exc:
        raise ArchiveError(f"not importing into {path}: {getattr(exc, 'reason', None) or exc}") from None
    problem = trust.path_problem(root, path)
    if problem:
        raise ArchiveError(f"not importing into {path}: {problem}")


def _expanded_size(members: list[tarfile.TarInfo], archive: Path, limit: int) -> None:
    total = sum(m.size for m in members if m.isfile())
    if total > limit:
        raise ArchiveError(f"{archive} expands to {total} bytes, more than the {limit} allowed; "
                           "refusing the archive")


def import_archive(root: Path, archive: Path, max_bytes: int = MAX_IMPORT_BYTES) -> dict:
    """Place the caches of an exported archive under `root`, all or nothing.

    Every member is checked before anything is written (relative, under
    `torch_compile_cache/<hash>/` or `entrypoints/`, a regular file or directory) and the sizes
    they expand to are summed against `max_bytes`; then the archive is extracted into a private
    temp dir inside the root, every file an index names is checked against its digest, and a
    cache of only those files is renamed into place. A cache or entry point already present is
    left as it is (never overwritten). Returns {"imported", "present", "entrypoints"}.
    """
    root = Path(os.path.abspath(root))
    with _open_archive(archive) as tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise ArchiveError(f"{archive} is not a readable .tar.gz archive ({exc})") from None
        for member in members:
            _member_target(member)  # refuse before writing a single byte
        _expanded_size(members, archive, max_bytes)
        caches = caches_dir(root)
        _mkdir_owned(root, caches)
        staging = Path(tempfile.mkdtemp(prefix=".import-", dir=str(caches)))
        try:
            try:
                hashes, points = _extract(tar, staging)
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise ArchiveError(f"{archive} is truncated or damaged ({exc}); nothing was imported") from None
            return _place(root, staging, hashes, points)
        finally:
            trust.remove_tree(root, staging)


def _assemble(staging: Path, cache_hash: str, pieces: list) -> Path:
    """A new directory holding only the named, verified files of a staged cache."""
    staged, clean = staging / "caches" / cache_hash, staging / "clean" / cache_hash
    trust.make_private_dirs(staging, clean)
    files = [staged / FACTORS_FILE] if (staged / FACTORS_FILE).is_file() else []
    for piece in pieces:
        files.append(piece.path / INDEX_FILE)
        files += [piece.path / rel for rel in piece.artifact_paths]
        if piece.dynamo_function:
            files.append(piece.path / piece.dynamo_function["path"])
        files += [piece.path / SCRATCH_DIR / rel for rel in piece.inductor_files]
    for source in sorted(set(files)):
        target = clean / source.relative_to(staged)
        trust.make_private_dirs(staging, target.parent)
        st = os.lstat(source)
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveError(f"the archive's {source.relative_to(staged)} is not a regular file")
        os.rename(source, target)
        os.chmod(target, trust.FILE_MODE | (st.st_mode & 0o100))
    _relink_shared(clean)
    return clean


def _place(root: Path, staging: Path, hashes: set[str], points: list[str]) -> dict:
    if not hashes:
        raise ArchiveError("the archive holds no cache (no torch_compile_cache/<hash>/ directory)")
    caches = caches_dir(root)
    clean = {h: _assemble(staging, h, _check_staged(staging, staging / "caches" / h, h)) for h in sorted(hashes)}
    for name in points:
        _check_entrypoint(staging, staging / ENTRYPOINTS / name, hashes)
    imported, present = [], []
    for cache_hash, source in clean.items():
        target = caches / cache_hash
        if os.path.lexists(target):
            present.append(cache_hash)
            continue
        try:
            os.rename(source, target)  # atomic: the cache appears whole or not at all
        except OSError:
            if os.path.lexists(target):  # another import won the race
                present.append(cache_hash)
                continue
            raise
        imported.append(cache_hash)
    placed = 0
    if points:
        _mkdir_owned(root, caches / ENTRYPOINTS)
    for name in points:
        try:  # a link never replaces an existing name: an entry point already there stays
            os.link(staging / ENTRYPOINTS / name, caches / ENTRYPOINTS / name)
            placed += 1
        except FileExistsError:
            continue
    return {"imported": imported, "present": present, "entrypoints": placed}
