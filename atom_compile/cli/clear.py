"""`clear`: remove whole caches (named, all, older than, or least recently used over a size)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

from ..cache import inventory as inv
from ..cache import removal
from ..cache.store import caches_dir
from . import output as out
from .common import CliError, hash_text, resolve_root

HELP = "remove caches"
EPILOG = """Removes whole caches (and the entry points that name them). A cache that a running process
uses is never removed: it is skipped and named. Without --yes, clear asks on a terminal and
refuses in a script.

examples:
  atom-compile-cache clear --max-size 2G --yes
  atom-compile-cache clear --older-than 30 --dry-run
  atom-compile-cache clear ea87848f33757d9c --yes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hashes", nargs="*", metavar="HASH", type=hash_text, help="remove these caches")
    p.add_argument("--all", action="store_true", help="remove every cache")
    p.add_argument("--older-than", type=float, metavar="DAYS", help="remove caches not used for DAYS days")
    p.add_argument("--max-size", metavar="SIZE", help="remove least recently used caches until the rest fits (2G, 500M)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")


def check(args: argparse.Namespace) -> None:
    chosen = [bool(args.hashes), args.all, args.older_than is not None, args.max_size is not None]
    if sum(chosen) > 1:
        raise CliError("give one of --all, HASH..., --older-than or --max-size", 2)


def _selection(args: argparse.Namespace, root: Path) -> tuple[list[inv.CacheInfo], str]:
    """The caches to remove, least recently used first, and how they were chosen."""
    if args.hashes:
        return [inv.read_cache(root, inv.resolve_hash(root, h)) for h in args.hashes], "named"
    caches = inv.list_caches(root)
    if args.all:
        return caches, "all"
    if args.older_than is not None:
        if not math.isfinite(args.older_than) or args.older_than < 0:
            raise CliError(f"--older-than: got {args.older_than}; allowed: a finite number of days >= 0", 2)
        return removal.select_older(caches, args.older_than), "older"
    if args.max_size is not None:
        return sorted(caches, key=lambda c: c.last_used or 0.0), "max-size"
    raise CliError("say what to clear: --all, HASH..., --older-than DAYS or --max-size SIZE", 2)


def _confirmed(n: int, size: str, yes: bool) -> bool:
    if yes:
        return True
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError(f"refusing to remove {out.plural(n, 'cache')} ({size}) without --yes (not a terminal); "
                       "add --yes, or --dry-run to list them", 2)
    # The prompt on stdout ourselves: input() may write it to stderr when both ends are terminals.
    sys.stdout.write(f"Remove {out.plural(n, 'cache')} ({size})? [y/N] ")
    sys.stdout.flush()
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    check(args)
    root = resolve_root(args)
    candidates, how = _selection(args, root)
    limit = inv.parse_size(args.max_size) if how == "max-size" else None
    planned = removal.select_lru(candidates, limit) if limit is not None else candidates
    size = out.size(sum(c.bytes for c in planned))
    if args.dry_run or not planned:
        return _report_plan(planned, size, args.json, dry_run=args.dry_run)
    if not _confirmed(len(planned), size, args.yes):
        print("Aborted, nothing removed.")
        return 0
    results = _remove(root, candidates, limit)
    removed = [r for r in results if r.removed]
    gone = {r.hash for r in removed}
    if how == "all":  # dangling and unreadable entry points go too
        gone |= {p.hash for p in inv.entrypoints(root) if p.hash and not inv.hash_dir(root, p.hash).exists()}
    points = removal.remove_entrypoints(root, gone, unreadable=how == "all")
    kept = [r for r in results if not r.removed]
    if args.json:
        out.emit({"removed": [r.hash for r in removed], "bytes": sum(r.bytes for r in removed),
                  "kept": [{"hash": r.hash, "reason": r.reason} for r in kept], "entrypoints_removed": len(points)})
    else:
        print(f"Removed {out.plural(len(removed), 'cache')} ({out.size(sum(r.bytes for r in removed))}) "
              f"and {out.plural(len(points), 'entry point')} from {caches_dir(root)}")
        for r in kept:
            out.note(f"kept {r.hash}: {r.reason}")
    return 1 if how == "named" and kept else 0


def _remove(root: Path, candidates: list[inv.CacheInfo], limit: Optional[int]) -> list[removal.Removal]:
    """Remove each candidate in order; with a size limit, stop once the rest fits (a cache
    kept because it is in use still counts, so the next one goes instead)."""
    total = sum(c.bytes for c in inv.list_caches(root)) if limit is not None else 0
    results = []
    for info in candidates:
        if limit is not None and total <= limit:
            break
        result = removal.remove_cache(root, info)
        results.append(result)
        if result.removed:
            total -= info.bytes
    return results


def _report_plan(planned: list[inv.CacheInfo], size: str, as_json: bool, dry_run: bool) -> int:
    if as_json:
        out.emit({"dry_run": dry_run, "would_remove" if dry_run else "removed":
                  [{"hash": c.hash, "bytes": c.bytes, "last_used": c.last_used} for c in planned],
                  "bytes": sum(c.bytes for c in planned)})
        return 0
    if not planned:
        print("Nothing to remove.")
        return 0
    print(f"Would remove {out.plural(len(planned), 'cache')} ({size}):")
    out.lines(out.table(("HASH", "SIZE", "LAST USED"),
                        [(c.hash, out.size(c.bytes), out.when(c.last_used)) for c in planned],
                        indent="  ", right=("SIZE",)))
    return 0
