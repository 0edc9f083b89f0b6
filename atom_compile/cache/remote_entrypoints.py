"""Entry points on the remote tier: so a machine with an empty cache skips Dynamo as well.

An entry point (`<root>/torch_compile_cache/entrypoints/<key>.json`) names the cache that holds
a saved Dynamo function and the traced sources it was made from. Its remote copy is signed like
a cache entry (over `entrypoints/<key>` and its text); pulling one pulls the cache it names
first and writes the entry point last. The loader then checks the sources' digests as for a
local entry point: a machine whose sources differ traces again.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Optional

from .._version import __version__
from . import signing, trust
from .remote import PREFIX, Refused, RemoteTier, Unavailable
from .files import atomic_write
from .store import HASH_RE, PieceCache, caches_dir

ENTRYPOINTS = "entrypoints"  # the directory aot.py writes entry points to, under caches_dir

FORMAT = "atom-compile-remote-entrypoint"
_KEY_RE = re.compile(r"^[0-9a-f]{32}$")


def _remote_key(key: str) -> str:
    return f"{PREFIX}/entrypoints/{key}.json"


def publish_entrypoint(tier: RemoteTier, key: str, text: str) -> bool:
    """Upload one entry point's text, signed (after the cache it names was published)."""
    name = f"entrypoints/{key}"
    doc = {"format": FORMAT, "format_version": 1, "atom_compile_version": __version__, "name": name,
           "text": text, "signature": signing.sign(tier.key, name, text), "publisher": socket.gethostname()}
    try:
        tier._call("writing an entry point", tier.store.put, _remote_key(key), json.dumps(doc).encode())
    except Unavailable:
        return False
    return True


def _parse(tier: RemoteTier, key: str, raw: bytes) -> tuple[str, str, str]:
    """(text, hash, prefix) of a signed remote entry point; Refused if unusable."""
    name = f"entrypoints/{key}"
    try:
        doc = trust.loads_bounded(raw.decode())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("name") != name:
            raise Refused("not an atom-compile remote entry point for this key")
        text = doc.get("text")
        if not isinstance(text, str) or not signing.check(tier.key, name, text, doc.get("signature")):
            raise Refused("its signature does not verify (unsigned, signed with another key, or altered)")
        entry = trust.loads_bounded(text)
        cache_hash, prefix = str(entry["hash"]), str(entry["prefix"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise Refused(f"the entry point is damaged ({type(exc).__name__}: {str(exc)[:100]})") from None
    if not HASH_RE.match(cache_hash):
        raise Refused(f"the entry point names no cache hash ({cache_hash[:40]!r})")
    return text, cache_hash, prefix


def pull_entrypoint(tier: RemoteTier, root: Path, key: str, path: Path, rank: int) -> bool:
    """Fetch entry point `key` and the cache it names into `root`, the entry point (at `path`)
    last; True if the entry point is now local. Refusals and outages are said once."""
    if not _KEY_RE.match(key):
        return False
    try:
        raw = tier._call("reading an entry point", tier.store.get, _remote_key(key), trust.MAX_JSON_BYTES)
        if raw is None:
            return False
        text, cache_hash, prefix = _parse(tier, key, raw)
    except Unavailable:
        return False
    except Refused as exc:
        tier.refuse(f"entry point {key}", exc, "tracing locally")
        return False
    try:
        cache: Optional[PieceCache] = PieceCache.open(root, cache_hash, rank, prefix)
    except ValueError:
        return False
    if cache is None or (not os.path.lexists(cache.index_path) and not tier.pull(cache)):
        return False
    try:
        trust.make_private_dirs(root, path.parent)
        atomic_write(path, text.encode())
    except OSError as exc:
        cache.write_failed(path, exc)
        return False
    return True


def push_entrypoints(tier: RemoteTier, root: Path) -> dict[str, bool]:
    """Publish every local entry point (after the caches they name): {entrypoints/<key>: published}."""
    out = {}
    for path in sorted((caches_dir(root) / ENTRYPOINTS).glob("*.json")):
        if not _KEY_RE.match(path.stem):
            continue
        try:
            text = trust.read_bytes(root, path, trust.MAX_JSON_BYTES).decode()
        except (OSError, UnicodeDecodeError):
            out[f"entrypoints/{path.stem}"] = False
            continue
        out[f"entrypoints/{path.stem}"] = publish_entrypoint(tier, path.stem, text)
    return out
