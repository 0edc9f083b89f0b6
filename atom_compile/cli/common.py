"""What every subcommand shares: the error type, and the cache root, checked once."""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path
from typing import Optional

from ..cache.store import cache_root
from ..errors import AtomCompileError


class CliError(AtomCompileError):
    """One line for stderr and the exit code (1 damage or miss, 2 usage)."""

    def __init__(self, message: str, code: int = 1, where: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.where = where


def _root_problem(path: Path) -> Optional[str]:
    """Why `path` cannot be a cache root (None: a directory we can read, or not there yet)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _parent_problem(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno == errno.ENOTDIR:
            return "a path through a file"
        return exc.strerror or str(exc)
    import stat

    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return "not readable"
    return None


def _parent_problem(path: Path) -> Optional[str]:
    """A root that does not exist yet is fine if its nearest existing parent is a directory."""
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            if os.path.islink(parent) and not os.path.exists(parent):
                return f"{parent} is a dangling symlink or a symlink loop"
            return None if os.path.isdir(parent) else f"a path through a file ({parent})"
    return None


def resolve_root(args: argparse.Namespace) -> Path:
    """The cache root of the command; a usage error (exit 2) if it cannot be a directory."""
    given: Optional[str] = getattr(args, "cache_root", None)
    if given is not None and not given.strip():
        raise CliError("--cache-root: got an empty path; allowed: a directory", 2)
    root = cache_root(given or "")
    problem = _root_problem(root)
    if problem is None:
        for sub in (root / "torch_compile_cache",):
            if os.path.lexists(sub) and not os.path.isdir(sub):
                problem = f"{sub.name} in it is not a directory"
    if problem:
        raise CliError(f"cache root {str(root)!r} is not usable: {problem}", 2)
    return root


def hash_text(text: str) -> str:
    """argparse type of a HASH argument: 4 to 16 hex digits (a unique prefix is enough)."""
    value = text.strip().lower()
    if not (4 <= len(value) <= 16 and all(c in "0123456789abcdef" for c in value)):
        raise argparse.ArgumentTypeError(f"bad cache hash {text!r}: expected 16 hex digits (or a unique prefix)")
    return value
