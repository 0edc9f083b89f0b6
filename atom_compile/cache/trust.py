"""The cache's trust model, enforced here and nowhere else.

Loading a cached artifact runs its code, so a file is only read or loaded when it and every
directory between it and the cache root:

- is reached without following a symbolic link (each step is opened with `O_NOFOLLOW`
  relative to the directory before it, so a link planted anywhere on the way is refused);
- is owned by the current user;
- is not writable by group or others.

Everything the package creates is private (directories 0700, files 0600) whatever the umask,
and nothing is deleted outside the cache root: removal walks down from the root the same way
and refuses links. JSON read from the cache is bounded in size and nesting before it is parsed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

from ..errors import AtomCompileError

DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 32

_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_O_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class Untrusted(AtomCompileError, OSError):
    """A path inside the cache that must not be read: `reason` says why."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def _uid() -> Optional[int]:
    return os.geteuid() if hasattr(os, "geteuid") else None


def stat_problem(st: os.stat_result, what: str = "it") -> Optional[str]:
    """Why a file or directory with this stat must not be trusted, or None."""
    uid = _uid()
    if stat.S_ISLNK(st.st_mode):
        return f"{what} is a symbolic link"
    if uid is not None and st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"{what} is writable by group or others (mode {oct(st.st_mode & 0o777)})"
    return None


def _parts(root: Path, path: Path) -> list[str]:
    try:
        rel = Path(os.path.normpath(path)).relative_to(os.path.normpath(root))
    except ValueError:
        raise Untrusted(path, f"it is outside the cache root {root}") from None
    parts = list(rel.parts)
    if any(p in ("", ".", "..") for p in parts):
        raise Untrusted(path, "its path leaves the cache root")
    return parts


def _open_root(root: Path) -> int:
    try:
        fd = os.open(root, _O_DIR)
    except OSError as exc:
        raise Untrusted(root, _os_reason(exc, "the cache root")) from None
    problem = stat_problem(os.fstat(fd), "the cache root")
    if problem is not None:
        os.close(fd)
        raise Untrusted(root, problem)
    return fd


def _os_reason(exc: OSError, what: str) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"{what} is a symbolic link or not a directory"
    if isinstance(exc, FileNotFoundError):
        return f"{what} is missing"
    return f"{what} cannot be opened ({exc.strerror or exc})"


def open_dir(root: Path, path: Path) -> int:
    """A file descriptor for directory `path` under `root`, every step checked; raises Untrusted."""
    fd = _open_root(root)
    walked = Path(root)
    try:
        for name in _parts(root, path):
            walked = walked / name
            try:
                child = os.open(name, _O_DIR, dir_fd=fd)
            except OSError as exc:
                raise Untrusted(walked, _os_reason(exc, "the directory")) from None
            os.close(fd)
            fd = child
            problem = stat_problem(os.fstat(fd), "the directory")
            if problem is not None:
                raise Untrusted(walked, problem)
        return fd
    except BaseException:
        os.close(fd)
        raise


def path_problem(root: Path, path: Path) -> Optional[str]:
    """None if `path` (file or directory) may be trusted, else why not (naming what failed)."""
    try:
        if Path(path) == Path(root):
            os.close(_open_root(root))
            return None
        dir_fd = open_dir(root, Path(path).parent)
    except Untrusted as exc:
        return f"{exc.path}: {exc.reason}"
    try:
        try:
            st = os.stat(Path(path).name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return f"{path}: it is missing"
        problem = stat_problem(st)
        return f"{path}: {problem}" if problem else None
    finally:
        os.close(dir_fd)


def open_file(root: Path, path: Path, limit: Optional[int] = None) -> int:
    """A read-only fd of regular file `path` under `root`, opened without following links and
    only if it and its directories are trusted; raises Untrusted (FileNotFoundError if missing)."""
    dir_fd = open_dir(root, Path(path).parent)
    try:
        try:
            fd = os.open(Path(path).name, _O_FILE, dir_fd=dir_fd)
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP: the file is a symbolic link
            raise Untrusted(path, _os_reason(exc, "the file")) from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(path, "it is not a regular file")
        problem = stat_problem(st)
        if problem is not None:
            raise Untrusted(path, problem)
        if limit is not None and st.st_size > limit:
            raise Untrusted(path, f"it is {st.st_size} bytes, more than the {limit} allowed")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(root: Path, path: Path, limit: Optional[int] = None) -> bytes:
    """The bytes of regular file `path` under `root`, read as `open_file` opens it."""
    with os.fdopen(open_file(root, path, limit), "rb") as f:
        return f.read()


def sha256_and_stat(root: Path, path: Path) -> tuple[str, os.stat_result]:
    """The sha256 (hex) of trusted regular file `path` under `root`, and the file's stat taken
    before it was read (the content hashed is this inode's); raises Untrusted/OSError."""
    digest = hashlib.sha256()
    with os.fdopen(open_file(root, path), "rb") as f:
        st = os.fstat(f.fileno())
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest(), st


def sha256_trusted(root: Path, path: Path) -> str:
    """The sha256 (hex) of trusted regular file `path` under `root`; raises Untrusted/OSError."""
    return sha256_and_stat(root, path)[0]


def unlink_in(root: Path, path: Path) -> None:
    """Remove the directory entry `path` (a file or a link, never followed) under trusted
    directories of `root`; missing is fine; raises Untrusted if its directory is not ours."""
    dir_fd = open_dir(root, Path(path).parent)
    try:
        st = os.stat(Path(path).name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            _remove_at(dir_fd, Path(path).name)
        else:
            os.unlink(Path(path).name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def make_private(path: Path) -> None:
    """Strip group/other bits from `path` (not following a link), and make a directory 0700."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return
    mode = DIR_MODE if stat.S_ISDIR(st.st_mode) else (st.st_mode & 0o700) | 0o600
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in a JSON text (strings ignored), without parsing."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    depth = deepest = 0
    for ch in stripped:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_bounded(text: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for text read from the cache: size and nesting capped first, so a hostile
    document is a ValueError, never a RecursionError or a memory blow-up."""
    if len(text) > max_bytes:
        raise ValueError(f"{len(text)} bytes, more than the {max_bytes} allowed")
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"nested {depth} deep, more than the {max_depth} allowed")
    return json.loads(text)


def make_private_dir(path: Path) -> None:
    """Create `path` as a 0700 directory (chmod after mkdir: the umask only ever removes bits)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)


def make_private_dirs(root: Path, path: Path) -> None:
    """Create every missing directory from `root` (itself included) down to `path`, private."""
    root = Path(root)
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, DIR_MODE)
    current = root
    for name in _parts(root, path):
        current = current / name
        make_private_dir(current)


def remove_tree(root: Path, path: Path) -> None:
    """Delete `path` (file or directory) under `root` without ever following a link out of it:
    the walk goes through directory fds opened with O_NOFOLLOW, and a link is unlinked, never
    entered. Raises Untrusted if `path` is not below `root` or its parent chain is not ours."""
    parts = _parts(root, path)
    if not parts:
        raise Untrusted(path, "refusing to delete the cache root itself")
    parent_fd = open_dir(root, Path(path).parent)
    try:
        _remove_at(parent_fd, parts[-1])
    finally:
        os.close(parent_fd)


def _remove_at(dir_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            _remove_at(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def tree_problems(root: Path, path: Path, limit: int = 20) -> list[str]:
    """Every untrusted entry at or below directory `path` (links, foreign owners, writable by
    group/others), at most `limit`; the walk never follows a link."""
    problem = path_problem(root, path)
    if problem is not None:
        return [problem]
    found: list[str] = []
    stack = [Path(path)]
    while stack and len(found) < limit:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError as exc:
            found.append(f"{current}: cannot be listed ({exc.strerror or exc})")
            continue
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            problem = stat_problem(st)
            if problem is not None:
                found.append(f"{entry.path}: {problem}")
            elif stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
    return found[:limit]


def exception_in(exc: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """The exception of type `kind` behind `exc` (itself, or along its causes and contexts)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def os_error_in(exc: BaseException) -> Optional[OSError]:
    """The OSError behind an exception, if any (Inductor wraps the errors of its workers)."""
    return exception_in(exc, OSError)  # type: ignore[return-value]


@contextlib.contextmanager
def private_umask():
    """Everything Inductor creates while this is held is private to the user (umask 077)."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)
