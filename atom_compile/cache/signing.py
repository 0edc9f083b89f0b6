"""The remote tier's key and signatures: HMAC-SHA256 over a cache's name and its index.

The index names every artifact and Inductor file with its sha256, so a signature over the
index text binds every byte of the entry; each object fetched is then checked against its
digest. The key comes from ATOM_COMPILE_REMOTE_KEY or from a key file that must be private
(a regular file, the user's own, mode 0600 or stricter), because whoever holds the key can
make this process run code.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Optional

MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


class KeyProblem(ValueError):
    """The configured key cannot be used (the message says why and what is allowed)."""


def _key_file_bytes(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise KeyProblem(f"ATOM_COMPILE_REMOTE_KEY_FILE={path!r}: cannot open it "
                         f"({exc.strerror or exc}; a link is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyProblem(f"ATOM_COMPILE_REMOTE_KEY_FILE={path!r}: not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise KeyProblem(f"ATOM_COMPILE_REMOTE_KEY_FILE={path!r}: owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o077:
            raise KeyProblem(f"ATOM_COMPILE_REMOTE_KEY_FILE={path!r}: mode {stat.S_IMODE(st.st_mode):o}; "
                             "allowed: readable by its owner only (chmod 600)")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyProblem(f"ATOM_COMPILE_REMOTE_KEY_FILE={path!r}: over {MAX_KEY_FILE_BYTES} bytes")
    return data.strip()


def load_key(key: Optional[str], key_file: Optional[str]) -> Optional[bytes]:
    """The signing key (the variable wins over the file), None if neither is set; KeyProblem
    if the one given is unusable (a key file that is not private, a key under 16 bytes)."""
    if key:
        data = key.encode()
        where = "ATOM_COMPILE_REMOTE_KEY"
    elif key_file:
        data = _key_file_bytes(key_file)
        where = f"ATOM_COMPILE_REMOTE_KEY_FILE={key_file!r}"
    else:
        return None
    if len(data) < MIN_KEY_BYTES:
        raise KeyProblem(f"{where}: {len(data)} bytes; allowed: a secret of at least {MIN_KEY_BYTES} bytes")
    return data


def _message(cache_name: str, index_text: str) -> bytes:
    return b"atom-compile-remote-v1\0" + cache_name.encode() + b"\0" + hashlib.sha256(index_text.encode()).digest()


def sign(key: bytes, cache_name: str, index_text: str) -> str:
    """The hex HMAC-SHA256 of one cache's name and index text."""
    return hmac.new(key, _message(cache_name, index_text), hashlib.sha256).hexdigest()


def check(key: bytes, cache_name: str, index_text: str, signature: object) -> bool:
    """Whether `signature` is this key's signature of the name and index (constant time)."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign(key, cache_name, index_text), signature)
