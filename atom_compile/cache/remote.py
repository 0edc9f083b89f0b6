"""The remote tier behind the local cache: pull a signed cache on a local miss, publish after a compile.

Remote layout (the same keys on Redis and on an fsspec directory)::

    atom-compile/v1/objects/<sha256>                        one artifact or Inductor file
    atom-compile/v1/entries/<hash>/rank_<r>/<prefix>.json   {"cache", "index", "signature", ...}

An entry carries the text of one local index and an HMAC-SHA256 over the cache's name and
that text; the index names every file by its sha256, so the signature covers every byte.
Publishing uploads the objects first and the entry last (each put is atomic), so a reader
never sees half an entry, and two publishers of the same cache write identical objects and
each a whole entry. A pulled entry is checked (signature, the index's own checks, each
object's digest) before a byte is written locally; the local trust checks then run as usual.
Any remote failure or a request slower than the timeout turns the tier off for the process
with one warning; the run continues on the local cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .._version import __version__
from ..errors import IndexInvalid
from . import signing, trust
from .index import check_manifest_path, check_rel_path, parse_index
from .remote_stores import RemoteStore, StoreError, open_store
from .scratch import SCRATCH_DIR
from .files import atomic_write
from .store import PieceCache, caches_dir, warn_once

logger = logging.getLogger("atom_compile")

PREFIX = "atom-compile/v1"
ENTRY_FORMAT = "atom-compile-remote-entry"
MAX_OBJECT_BYTES = 4 << 30

_tiers: dict[tuple, Optional["RemoteTier"]] = {}


class Refused(Exception):
    """A remote entry that must not be used; the message says why."""


class Unavailable(Exception):
    """The remote failed or did not answer in time (the tier is now off for the process)."""


def object_key(sha256: str) -> str:
    return f"{PREFIX}/objects/{sha256}"


def entry_key(name: str) -> str:
    return f"{PREFIX}/entries/{name}.json"


def cache_name(cache: PieceCache) -> str:
    """`<hash>/rank_<r>/<prefix>`: where a piece cache sits under any root."""
    return cache.path.relative_to(caches_dir(cache.root)).as_posix()


def named_files(index: dict) -> dict[str, str]:
    """Every file an index names, as {path under the piece directory: sha256}."""
    files = {check_rel_path(e["handle"]["path"]): e["sha256"] for e in index["entries"]}
    dynamo = index.get("dynamo_function")
    if dynamo:
        files[check_rel_path(dynamo["path"])] = dynamo["sha256"]
    for rel, digest in (index.get("inductor_files") or {}).items():
        files[f"{SCRATCH_DIR}/{check_manifest_path(rel)}"] = digest
    return files


def parse_entry(raw: bytes, name: str, key: bytes) -> tuple[str, dict]:
    """(index text, parsed index) of a remote entry for cache `name`; Refused if unusable."""
    try:
        doc = trust.loads_bounded(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(f"the entry is not JSON ({str(exc)[:100]})") from None
    if not isinstance(doc, dict) or doc.get("format") != ENTRY_FORMAT or not isinstance(doc.get("index"), str):
        raise Refused("the entry is not an atom-compile remote entry")
    if doc.get("cache") != name:
        raise Refused(f"the entry names cache {str(doc.get('cache'))[:80]!r}, not {name!r}")
    if not signing.check(key, name, doc["index"], doc.get("signature")):
        raise Refused("its signature does not verify (unsigned, signed with another key, or altered)")
    try:
        return doc["index"], parse_index(doc["index"])
    except IndexInvalid as exc:
        raise Refused(f"its index is unusable: {exc}") from None


class RemoteTier:
    """One remote store and the key that signs its entries, for the life of the process."""

    def __init__(self, store: RemoteStore, key: bytes, timeout: float):
        self.store = store
        self.key = key
        self.timeout = timeout
        self.down = False
        self._bad_objects: set[str] = set()
        self._refused = False
        self._synced: dict[str, str] = {}  # cache name -> sha256 of the index text last pulled/pushed

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) within the timeout; Unavailable (and the tier off, one warning) if not."""
        if self.down:
            raise Unavailable(self.store.url)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=target, name="atom-compile-remote", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if "value" in box or ("error" not in box and not thread.is_alive()):
            return box.get("value")
        error = box.get("error")
        # A client's own timeout (socket, redis) is the same hang as the watchdog's.
        if thread.is_alive() or isinstance(error, TimeoutError) or type(error).__name__ == "TimeoutError":
            reason = f"no answer within {self.timeout:g} s"
        else:
            reason = f"{type(error).__name__}: {str(error)[:200]}"
        self.down = True
        warn_once(f"remote-down:{self.store.url}", "atom-compile: the remote cache %s failed while %s (%s); "
                  "continuing with the local cache only in this process.", self.store.url, what, reason)
        raise Unavailable(self.store.url)

    def refuse(self, what: str, reason: object, consequence: str) -> None:
        """Say why a remote entry is not used: a warning the first time in the process, then info."""
        message = f"atom-compile: refusing the remote {what} from {self.store.url}: {reason}; {consequence}."
        if self._refused:
            logger.info(message)
        else:
            self._refused = True
            logger.warning(message)

    # --- pull --------------------------------------------------------------------------------

    def pull(self, cache: PieceCache) -> bool:
        """Fill an empty local cache from its signed remote entry; True if it was installed."""
        name = cache_name(cache)
        start = time.perf_counter()
        try:
            raw = self._call("reading an entry", self.store.get, entry_key(name), trust.MAX_JSON_BYTES)
            if raw is None:
                return False
            text, index = parse_entry(raw, name, self.key)
            blobs = self._fetch_objects(cache, named_files(index))
        except Unavailable:
            return False
        except (Refused, IndexInvalid) as exc:
            self.refuse(f"cache entry {name}", exc, "compiling locally")
            return False
        installed = self._install(cache, text, blobs)
        if installed:
            self._synced[name] = hashlib.sha256(text.encode()).hexdigest()
            logger.info("atom-compile: pulled %s from %s (%d files, %d bytes) in %.2fs", name, self.store.url,
                        len(blobs), sum(len(b) for b in blobs.values()), time.perf_counter() - start)
        return installed

    def _fetch_objects(self, cache: PieceCache, files: dict[str, str]) -> dict[str, bytes]:
        """The bytes of each file not already present locally, each checked against its digest."""
        blobs = {}
        for rel, digest in files.items():
            if _local_digest(cache, rel) == digest:
                continue
            data = self._call("reading an object", self.store.get, object_key(digest), MAX_OBJECT_BYTES)
            if data is None:
                raise Refused(f"its object {digest[:12]}... ({rel}) is missing")
            if hashlib.sha256(data).hexdigest() != digest:
                self._bad_objects.add(digest)
                raise Refused(f"its object {digest[:12]}... ({rel}, {len(data)} bytes) does not match its "
                              "digest (truncated or altered)")
            blobs[rel] = data
        return blobs

    def _install(self, cache: PieceCache, text: str, blobs: dict[str, bytes]) -> bool:
        """Write the files, then the index last, under the cache's lock; False if it cannot."""
        try:
            with cache._lock():
                if os.path.lexists(cache.index_path):
                    return False  # another process filled it meanwhile: its index and files stand
                for rel, data in blobs.items():
                    path = cache.path / rel
                    trust.make_private_dirs(cache.root, path.parent)
                    atomic_write(path, data)
                atomic_write(cache.index_path, text.encode())
        except OSError as exc:
            cache.write_failed(cache.path, exc)
            return False
        return True

    # --- publish -----------------------------------------------------------------------------

    def publish(self, cache: PieceCache) -> bool:
        """Upload the local cache's files, then its signed entry; True if it was published."""
        name = cache_name(cache)
        try:
            text = trust.read_bytes(cache.root, cache.index_path, trust.MAX_JSON_BYTES).decode()
            files = named_files(parse_index(text))
        except (OSError, UnicodeDecodeError, IndexInvalid) as exc:
            logger.info("atom-compile: not publishing %s: its local index is unusable (%s)", name, exc)
            return False
        digest = hashlib.sha256(text.encode()).hexdigest()
        if self._synced.get(name) == digest:
            return False
        try:
            for rel, sha in files.items():
                self._upload(cache, rel, sha)
            doc = {"format": ENTRY_FORMAT, "format_version": 1, "atom_compile_version": __version__,
                   "cache": name, "index": text, "signature": signing.sign(self.key, name, text),
                   "publisher": socket.gethostname(), "published": time.time()}
            self._call("writing an entry", self.store.put, entry_key(name), json.dumps(doc).encode())
        except Unavailable:
            return False
        except Refused as exc:
            logger.info("atom-compile: not publishing %s: %s", name, exc)
            return False
        self._synced[name] = digest
        logger.info("atom-compile: published %s to %s", name, self.store.url)
        return True

    def _upload(self, cache: PieceCache, rel: str, sha: str) -> None:
        key = object_key(sha)
        if sha not in self._bad_objects and self._call("checking an object", self.store.exists, key):
            return
        try:
            data = trust.read_bytes(cache.root, cache.path / rel)
        except OSError as exc:
            raise Refused(f"{rel} cannot be read ({exc})") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise Refused(f"{rel} does not match its digest in the index")
        self._call("writing an object", self.store.put, key, data)
        self._bad_objects.discard(sha)


def _local_digest(cache: PieceCache, rel: str) -> Optional[str]:
    try:
        return trust.sha256_trusted(cache.root, cache.path / rel)
    except OSError:
        return None


def tier_for(url: Optional[str], key: Optional[str], key_file: Optional[str],
             timeout: float) -> Optional[RemoteTier]:
    """The process's tier for `url` (None: no URL, no usable key, or a bad URL, each said once)."""
    if not url:
        return None
    ident = (url, key, key_file, timeout)
    if ident in _tiers:
        return _tiers[ident]
    tier = None
    try:
        secret = signing.load_key(key, key_file)
        if secret is None:
            logger.warning("atom-compile: the remote cache %s is off: no key is set (ATOM_COMPILE_REMOTE_KEY or "
                           "ATOM_COMPILE_REMOTE_KEY_FILE); loading an artifact runs its code, and an unsigned "
                           "one could come from anyone who can write to the store.", url)
        else:
            tier = RemoteTier(open_store(url, timeout), secret, timeout)
    except (signing.KeyProblem, StoreError) as exc:
        logger.warning("atom-compile: the remote cache is off: %s", exc)
    _tiers[ident] = tier
    return tier


def list_entries(tier: RemoteTier) -> list[str]:
    """The cache names the remote holds entries for."""
    start = f"{PREFIX}/entries/"
    keys = tier._call("listing entries", tier.store.keys, start)
    return [k[len(start):-len(".json")] for k in keys if k.endswith(".json")]


def local_piece_dirs(root: Path) -> list[tuple[str, int, str]]:
    """(hash, rank, prefix) of every piece directory under `root` that has an index."""
    out = []
    for index in sorted(caches_dir(root).glob("*/rank_*/*/index.json")):
        prefix_dir = index.parent
        rank = prefix_dir.parent.name[len("rank_"):]
        if rank.isdigit():
            out.append((prefix_dir.parent.parent.name, int(rank), prefix_dir.name))
    return out


def _matches(name: str, only: Optional[str]) -> bool:
    return only is None or name == only or name.split("/", 1)[0] == only


def push_all(tier: RemoteTier, root: Path, only: Optional[str] = None) -> dict[str, bool]:
    """Publish every local piece cache (or those of one `<hash>`, or one name): {name: published}."""
    out = {}
    for cache_hash, rank, prefix in local_piece_dirs(root):
        cache = PieceCache(root, cache_hash, rank, prefix)
        name = cache_name(cache)
        if _matches(name, only):
            out[name] = tier.publish(cache)
    return out


def pull_all(tier: RemoteTier, root: Path, only: Optional[str] = None) -> dict[str, bool]:
    """Pull every remote entry (or one `<hash>`, or one name) missing locally: {name: pulled}."""
    out = {}
    for name in list_entries(tier):
        parts = name.split("/")
        if len(parts) != 3 or not parts[1].startswith("rank_") or not parts[1][5:].isdigit() \
                or not _matches(name, only):
            continue
        try:
            cache = PieceCache.open(root, parts[0], int(parts[1][5:]), parts[2])
        except ValueError:
            continue  # a name that is no cache of ours
        if cache is not None and not os.path.lexists(cache.index_path):
            out[name] = tier.pull(cache)
        else:
            out[name] = False
    return out


def check_entry(tier: RemoteTier, name: str, objects: bool) -> dict[str, Any]:
    """What the remote holds for `name`: publisher, time, files and whether it verifies
    (the signature; with `objects`, each object's digest too). Unavailable if the remote fails."""
    out: dict[str, Any] = {"name": name, "ok": False, "reason": None, "publisher": None, "published": None,
                           "files": 0, "bytes": 0}
    raw = tier._call("reading an entry", tier.store.get, entry_key(name), trust.MAX_JSON_BYTES)
    if raw is None:
        out["reason"] = "no entry"
        return out
    try:
        doc = trust.loads_bounded(raw.decode())
        if isinstance(doc, dict):
            out["publisher"], out["published"] = doc.get("publisher"), doc.get("published")
        _, index = parse_entry(raw, name, tier.key)
        files = named_files(index)
        out["files"] = len(files)
        if objects:
            for rel, digest in files.items():
                data = tier._call("reading an object", tier.store.get, object_key(digest), MAX_OBJECT_BYTES)
                if data is None or hashlib.sha256(data).hexdigest() != digest:
                    raise Refused(f"object {digest[:12]}... ({rel}) is " + ("missing" if data is None else
                                  "truncated or altered"))
                out["bytes"] += len(data)
    except (UnicodeDecodeError, ValueError, Refused, IndexInvalid) as exc:
        out["reason"] = str(exc)
        return out
    out["ok"] = True
    return out
