"""Two plain file operations of the cache: a file's sha256, and an atomic private write."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

from . import trust


def sha256_file(path: str) -> Optional[str]:
    """The file's sha256 (hex), or None if it cannot be read (files outside the cache)."""
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
    except OSError:
        return None


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` (0600) through a temp file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, trust.FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
