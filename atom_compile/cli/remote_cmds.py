"""`push`, `pull`, and the remote halves of `inspect --remote` and `verify --remote`.

The remote is --remote-cache URL, else $ATOM_COMPILE_REMOTE_CACHE; the signing key is
$ATOM_COMPILE_REMOTE_KEY or $ATOM_COMPILE_REMOTE_KEY_FILE (without one nothing is read or written).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from .. import envs
from ..cache import remote, signing
from ..cache.remote_entrypoints import push_entrypoints
from ..cache.remote_stores import StoreError
from . import output as out
from .common import CliError, resolve_root

PUSH_HELP = "publish local caches to the remote cache, signed"
PUSH_EPILOG = """Uploads each cache's artifacts and Inductor files (those the remote lacks), then its
signed index last, so a reader never sees half a cache. CACHE is a hash or HASH/rank_R/PREFIX.

examples:
  ATOM_COMPILE_REMOTE_KEY_FILE=~/.atom-key atom-compile-cache push --remote-cache redis://cache:6379/0
  atom-compile-cache push ea87848f33757d9c --json
"""
PULL_HELP = "fetch the remote's caches that are missing locally, verified"
PULL_EPILOG = """Checks each entry's signature and each object's sha256 before writing a byte; a cache
already present locally is never touched. CACHE is a hash or HASH/rank_R/PREFIX.

examples:
  atom-compile-cache pull --remote-cache file:///shared/atom-cache
  atom-compile-cache pull ea87848f33757d9c --json
"""


def add_remote_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-cache", metavar="URL", default=None,
                   help="redis://host:port/db or an fsspec URL (default: $ATOM_COMPILE_REMOTE_CACHE)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("caches", nargs="*", metavar="CACHE", help="these caches only (default: all)")
    add_remote_option(p)


def open_tier(args: argparse.Namespace) -> remote.RemoteTier:
    """The tier the command names; a usage error (exit 2) naming what is missing or wrong."""
    url = getattr(args, "remote_cache", None) or envs.remote_cache()
    if not url:
        raise CliError("no remote cache: give --remote-cache URL or set ATOM_COMPILE_REMOTE_CACHE", 2)
    try:
        key = signing.load_key(envs.remote_key(), envs.remote_key_file())
        if key is None:
            raise CliError("no signing key: set ATOM_COMPILE_REMOTE_KEY or ATOM_COMPILE_REMOTE_KEY_FILE "
                           "(without one the remote tier is off: its artifacts could not be trusted)", 2)
        timeout = envs.remote_timeout()
        return remote.RemoteTier(remote.open_store(url, timeout), key, timeout)
    except (signing.KeyProblem, StoreError) as exc:
        raise CliError(str(exc), 2) from None


def _each(args: argparse.Namespace, work: Callable[..., dict[str, bool]]) -> dict[str, bool]:
    tier = open_tier(args)
    root = resolve_root(args)
    done: dict[str, bool] = {}
    try:
        for only in args.caches or [None]:
            done.update(work(tier, root, only))
    except remote.Unavailable:
        raise CliError(f"the remote cache {tier.store.url} failed or did not answer in "
                       f"{tier.timeout:g} s (see the warning above)") from None
    return done


def _push(tier: remote.RemoteTier, root: Any, only: Any) -> dict[str, bool]:
    done = remote.push_all(tier, root, only)
    if only is None:  # entry points let an empty machine skip Dynamo too; they follow their caches
        done.update(push_entrypoints(tier, root))
    return done


def run_push(args: argparse.Namespace) -> int:
    done = _each(args, _push)
    if args.json:
        out.emit({"caches": [{"name": n, "pushed": ok} for n, ok in sorted(done.items())]})
    elif not done:
        print("No local caches to push.")
    else:
        out.lines(out.table(("CACHE", "STATE"), [(n, "pushed" if ok else "FAILED") for n, ok in sorted(done.items())]))
    return 0 if all(done.values()) else 1


def run_pull(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    before = set(_local_names(root))
    states = _each(args, remote.pull_all)
    if args.json:
        out.emit({"caches": [{"name": n, "pulled": ok, "present": n in before}
                             for n, ok in sorted(states.items())]})
    elif not states:
        print("The remote holds no caches.")
    else:
        rows = [(n, "pulled" if ok else "present" if n in before else "refused") for n, ok in sorted(states.items())]
        out.lines(out.table(("CACHE", "STATE"), rows))
    return 1 if any(not ok and n not in before for n, ok in states.items()) else 0


def _local_names(root: Any) -> list[str]:
    return [f"{h}/rank_{r}/{p}" for h, r, p in remote.local_piece_dirs(root)]


def run_remote_listing(args: argparse.Namespace, objects: bool) -> int:
    """`inspect --remote` (signatures) and `verify --remote` (signatures and every object)."""
    tier = open_tier(args)
    try:
        rows = [remote.check_entry(tier, name, objects) for name in remote.list_entries(tier)
                if not getattr(args, "hash", None) or name.startswith(str(args.hash))]
    except remote.Unavailable:
        raise CliError(f"the remote cache {tier.store.url} failed or did not answer in {tier.timeout:g} s") from None
    bad = [r for r in rows if not r["ok"]]
    if args.json:
        out.emit({"remote": tier.store.url, "ok": not bad, "caches": rows})
    elif not rows:
        print(f"No caches at {tier.store.url}.")
    else:
        table = out.table(("CACHE", "SIGNATURE" if not objects else "STATE", "FILES", "PUBLISHER", "PUBLISHED"),
                          [(r["name"], "ok" if r["ok"] else "REFUSED", r["files"], r["publisher"] or "-",
                            out.when(r["published"] if isinstance(r["published"], (int, float)) else None))
                           for r in rows], right=("FILES",))
        out.lines(table)
        for r in bad:
            print(f"  ! {r['name']}: {r['reason']}")
    return 1 if bad else 0

