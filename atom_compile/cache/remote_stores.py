"""Where the remote tier keeps its objects: Redis (the `redis` package) or any fsspec URL.

A store maps string keys to bytes. `put` is atomic: a reader sees the whole value or none of
it (Redis SET; fsspec writes a temporary object and renames it). Both packages are optional
(`pip install atom-compile[remote]`); the cloud filesystems (s3fs, gcsfs, ...) are the user's.
"""

from __future__ import annotations

import uuid
from typing import Optional, Protocol
from urllib.parse import urlparse

REDIS_SCHEMES = ("redis", "rediss", "unix")


class StoreError(ValueError):
    """A remote URL that cannot be used (bad form, unknown scheme, package missing)."""


class RemoteStore(Protocol):
    """Bytes by key, with atomic puts."""

    url: str

    def get(self, key: str, limit: int) -> Optional[bytes]:
        """The value, None if absent; ValueError if it is over `limit` bytes."""

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, all at once."""

    def exists(self, key: str) -> bool:
        """Whether `key` holds a value."""

    def keys(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`."""


class RedisStore:
    """A Redis database: redis://[user:password@]host:port/db (or rediss://, unix://)."""

    def __init__(self, url: str, timeout: float):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise StoreError(f"remote cache {url!r} needs the `redis` package "
                             "(pip install 'atom-compile[remote]')") from None
        self.url = url
        # The tier's watchdog owns the timeout; the client's own, a second later, only frees the
        # abandoned thread. Equal timeouts would race and name the same hang two ways.
        backstop = timeout + 1.0
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=backstop, socket_connect_timeout=backstop,
                                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        except ValueError as exc:
            raise StoreError(f"remote cache {url!r}: {exc}") from None

    def get(self, key: str, limit: int) -> Optional[bytes]:
        size = self._client.strlen(key)
        if size > limit:
            raise ValueError(f"{key} holds {size} bytes, over the {limit} allowed")
        return self._client.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._client.set(key, data)

    def exists(self, key: str) -> bool:
        return bool(self._client.exists(key))

    def keys(self, prefix: str) -> list[str]:
        pattern = prefix.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?") + "*"
        return sorted(k.decode() for k in self._client.scan_iter(match=pattern, count=1000))


class FsspecStore:
    """A directory of any fsspec filesystem: file:///srv/cache, s3://bucket/prefix, ..."""

    def __init__(self, url: str, timeout: float):
        try:
            import fsspec
        except ImportError:
            raise StoreError(f"remote cache {url!r} needs the `fsspec` package "
                             "(pip install 'atom-compile[remote]')") from None
        self.url = url
        try:
            self._fs, root = fsspec.core.url_to_fs(url)
        except ImportError as exc:
            raise StoreError(f"remote cache {url!r}: the filesystem for this scheme is not installed ({exc})") from None
        except (ValueError, TypeError) as exc:
            raise StoreError(f"remote cache {url!r}: {exc}") from None
        self._root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def get(self, key: str, limit: int) -> Optional[bytes]:
        try:
            with self._fs.open(self._path(key), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise ValueError(f"{key} holds over the {limit} bytes allowed")
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        self._fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        with self._fs.open(tmp, "wb") as f:
            f.write(data)
        try:
            self._fs.mv(tmp, path)
        except BaseException:
            self._fs.rm(tmp)
            raise

    def exists(self, key: str) -> bool:
        return bool(self._fs.exists(self._path(key)))

    def keys(self, prefix: str) -> list[str]:
        base = self._path(prefix).rsplit("/", 1)[0]
        try:
            found = self._fs.find(base)
        except FileNotFoundError:
            return []
        root = self._root + "/"
        out = [p[len(root):] for p in found if p.startswith(root)]
        return sorted(k for k in out if k.startswith(prefix) and "/.tmp-" not in k)


def open_store(url: str, timeout: float) -> RemoteStore:
    """The store for `url`; StoreError naming the URL if it cannot be used."""
    scheme = urlparse(url).scheme.lower()
    if not scheme or "://" not in url:
        raise StoreError(f"remote cache {url!r}: not a URL; allowed: redis://host:port/db or an fsspec URL "
                         "(file:///dir, s3://bucket/prefix, ...)")
    if scheme in REDIS_SCHEMES:
        return RedisStore(url, timeout)
    return FsspecStore(url, timeout)
