"""Inductor's own files for our pieces (`<prefix>/inductor/`): their manifest and their repair.

Inductor imports Python and loads C++ libraries from this directory, so it gets the same
protection as the artifacts: the index records a sha256 for every file in it (the manifest),
and before Inductor may use the directory every file is checked (trusted, named by the
manifest, digest equal, none missing). Damage is never repaired in place: a fresh private
directory is made and swapped in by rename, and the damaged one is removed without following
links.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Optional

from . import trust

SCRATCH_DIR = "inductor"


RUNTIME_FILES = (".tmp", ".lock", ".best_config", ".load_ok")


def _skipped(name: str) -> bool:
    """Files Inductor writes while it runs, not what it compiled: locks and temp files, its
    autotuning results (`.best_config`, rewritten when a later run tunes again, so a digest would
    read as damage) and torch 2.14's `<lib>.so.load_ok` markers (empty; written after a load,
    not needed by one). Their owner and mode are still checked by the walk."""
    return name.startswith(".") or name.endswith(RUNTIME_FILES)


def walk_stats(directory: Path) -> tuple[dict[str, os.stat_result], list[str]]:
    """({relative path: its lstat} of the files a manifest covers, problems) under `directory`,
    links never followed: a link, a foreign or group/world-writable entry is a problem."""
    files: dict[str, os.stat_result] = {}
    problems: list[str] = []
    base = os.fspath(directory).rstrip(os.sep) + os.sep
    stack = [os.fspath(directory)]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError as exc:
            problems.append(f"{current}: cannot be listed ({exc.strerror or exc})")
            continue
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            problem = trust.stat_problem(st)
            if problem is not None:
                problems.append(f"{entry.path}: {problem}")
            elif stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            elif stat.S_ISREG(st.st_mode) and not _skipped(entry.name):
                # scandir's paths extend the one it was given: the prefix is `base`
                files[entry.path[len(base):].replace(os.sep, "/")] = st
            elif not stat.S_ISREG(st.st_mode):
                problems.append(f"{entry.path}: it is not a regular file")
    return files, problems


def walk_files(directory: Path) -> tuple[list[str], list[str]]:
    """(relative paths of the files a manifest covers, problems) under `directory`, links never
    followed: a link, a foreign or group/world-writable entry is a problem, not a file."""
    files, problems = walk_stats(directory)
    return sorted(files), problems


# A digest known for a file (absolute path -> (its stat's identity then, sha256)). A commit
# records the manifest after each of our kernels' first launches, dozens in a capture: hashing
# every file each time cost a cold capture seconds. An unchanged file is not read again:
# same inode, size, mtime and ctime (a write or a chmod moves ctime, which no call can set
# back). As git's index does, a file changed less than RACY_NS before its hashing is not
# remembered: a coarse clock could give its next change the same times.
_known: dict[str, tuple[tuple, str]] = {}
RACY_NS = 2_000_000_000


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_digest(root: Path, path: Path, st: Optional[os.stat_result] = None) -> str:
    """The sha256 of trusted file `path` under `root`, not read again when `st` (its lstat from
    a walk that checked it) is the stat it was hashed with; raises Untrusted/OSError."""
    key = os.fspath(path)
    known = _known.get(key)
    if st is not None and known is not None and known[0] == _identity(st):
        return known[1]
    started = time.time_ns()
    digest, hashed = trust.sha256_and_stat(root, path)
    if max(hashed.st_mtime_ns, hashed.st_ctime_ns) < started - RACY_NS:
        _known[key] = (_identity(hashed), digest)
    else:
        _known.pop(key, None)
    return digest


def manifest(root: Path, directory: Path, files: Optional[dict[str, os.stat_result]] = None) -> dict[str, str]:
    """{path under `directory`: sha256} of its trusted files (untrusted ones are left out);
    `files`: `walk_stats(directory)`'s files, where the caller has walked it already."""
    if files is None:
        files, _ = walk_stats(directory)
    out = {}
    for rel in sorted(files):
        try:
            out[rel] = file_digest(root, Path(directory) / rel, files[rel])
        except OSError:
            continue
    return out


def scratch_problem(root: Path, directory: Path, recorded: dict[str, str]) -> Optional[str]:
    """None if every entry of `directory` is trusted and every file `recorded` names is there
    with its digest; else the first problem, naming the path. Files no digest names yet are a
    concurrent compile's (the directory is private): they are recorded by its next commit."""
    problem = trust.path_problem(root, directory)
    if problem is not None:
        return problem
    files, problems = walk_stats(directory)
    if problems:
        return problems[0]
    for rel, digest in recorded.items():
        path = Path(directory) / rel
        try:
            actual = file_digest(root, path, files.get(rel))
        except FileNotFoundError:
            return f"{path}: it is missing"
        except OSError as exc:
            return f"{path}: {getattr(exc, 'reason', None) or exc}"
        if actual != digest:
            return f"{path}: its sha256 is {actual[:12]}..., the index recorded {digest[:12]}..."
    return None


def fresh_scratch(root: Path, directory: Path, keep: Optional[dict[str, str]] = None) -> list[str]:
    """Replace `directory` by a new private one: made beside it, holding only the files of
    `keep` that are trusted and match their digests (copied), swapped in by rename; the old
    one (or a link) is moved aside and removed without following links. Returns the kept."""
    directory = Path(directory)
    tag = uuid.uuid4().hex[:12]
    fresh = directory.parent / f".{directory.name}-new-{tag}"
    trust.make_private_dir(fresh)
    kept = _copy_verified(root, directory, fresh, keep or {})
    old = directory.parent / f".{directory.name}-old-{tag}"
    try:
        os.rename(directory, old)
    except FileNotFoundError:
        old = None
    os.rename(fresh, directory)
    if old is not None:
        try:
            trust.remove_tree(root, old)
        except OSError:
            pass  # a foreign leftover we may not remove: hidden, never used, `verify` names it
    return kept


def _copy_verified(root: Path, source: Path, target: Path, keep: dict[str, str]) -> list[str]:
    kept = []
    if trust.path_problem(root, source) is not None:
        return kept
    for rel, digest in sorted(keep.items()):
        try:
            data = trust.read_bytes(root, source / rel)
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            continue
        trust.make_private_dirs(target, (target / rel).parent)
        fd = os.open(target / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     trust.FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        kept.append(rel)
    return kept


def make_private_tree(directory: Path) -> None:
    """Strip group/other bits from everything under `directory` (what Inductor created)."""
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            try:
                trust.make_private(Path(dirpath) / name)
            except OSError:
                continue


# Triton's files for our own kernels (see atom_compile/ops/kernel_dir.py), under the scratch
# directory so that the manifest, `verify`, export and the remote tier cover them.
OPS_KERNELS_DIR = "triton_ops"


def prune_unrecorded(root: Path, directory: Path, recorded: dict[str, str]) -> int:
    """Remove the files under `directory/triton_ops` that the manifest does not name; returns
    how many. Triton loads what it finds there without asking, so a file no digest covers (a
    run that ended before recording it, or one put there by hand) must not stay; the cost of
    removing a concurrent run's fresh file is a recompile of that kernel."""
    ops = Path(directory) / OPS_KERNELS_DIR
    if not os.path.isdir(ops) or os.path.islink(ops):
        return 0
    files, _ = walk_files(ops)
    removed = 0
    for rel in files:
        if f"{OPS_KERNELS_DIR}/{rel}" not in recorded:
            trust.unlink_in(root, ops / rel)
            removed += 1
    return removed


def isa_probe_dir(root: Path, path: Path) -> Optional[str]:
    """Where Inductor probes the CPU's vector ISA: one private directory that every cache
    under the root shares (the probe builds and loads test programs, seconds in a fresh
    directory, so a new cache must not pay it again); None if it is not ours to use."""
    try:
        if not os.path.lexists(path):
            trust.make_private_dir(path)
        problems = trust.tree_problems(root, path, limit=1)
    except OSError:
        return None
    return None if problems else str(path)
