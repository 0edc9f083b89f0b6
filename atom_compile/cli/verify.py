"""`verify`: every artifact and saved Dynamo function against the sha256 its index recorded."""

from __future__ import annotations

import argparse

from ..cache import inventory as inv
from ..cache.store import caches_dir
from ..cache.verify import verified_files, verify_cache
from . import output as out, remote_cmds
from .common import hash_text, resolve_root

HELP = "check every artifact against its recorded sha256"
EPILOG = """Checks every artifact and saved Dynamo function against the sha256 its index recorded,
and that every index parses. Exit 1 (with the damaged files listed) on damage.

examples:
  atom-compile-cache verify
  atom-compile-cache verify ea87848f33757d9c --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hashes", nargs="*", metavar="HASH", type=hash_text, help="verify these caches (default: all)")
    p.add_argument("--remote", action="store_true",
                   help="verify the remote cache instead: each entry's signature and every object's sha256")
    remote_cmds.add_remote_option(p)


def run(args: argparse.Namespace) -> int:
    if args.remote:
        args.hash = args.hashes[0] if len(args.hashes) == 1 else None
        return remote_cmds.run_remote_listing(args, objects=True)
    root = resolve_root(args)
    hashes = [inv.resolve_hash(root, h) for h in args.hashes] if args.hashes else inv.cache_hashes(root)
    results = [(info, verify_cache(info)) for info in (inv.read_cache(root, h) for h in hashes)]
    bad_points = [p for p in inv.entrypoints(root) if p.problem] if not args.hashes else []
    damaged = sum(1 for _, d in results if d) + len(bad_points)
    if args.json:
        out.emit({"root": str(caches_dir(root)), "ok": damaged == 0, "caches": [
            {"hash": i.hash, "ok": not d, "artifacts_checked": verified_files(i)[0],
             "dynamo_functions_checked": verified_files(i)[1], "files_checked": sum(verified_files(i)),
             "bytes": i.bytes, "cache_bytes": i.cache_bytes,
             "damaged": [{"path": str(x.path), "reason": x.reason} for x in d]} for i, d in results],
            "damaged_entrypoints": [{"path": str(p.path), "reason": p.problem} for p in bad_points]})
        return 1 if damaged else 0
    if not results:
        print(f"No caches under {caches_dir(root)}; nothing to verify.")
    rows = []
    for info, damage in results:
        artifacts, functions = verified_files(info)
        rows.append((info.hash, "DAMAGED" if damage else "ok", artifacts, functions, out.size(info.cache_bytes)))
    if rows:
        table = out.table(("HASH", "STATE", "ARTIFACTS", "DYNAMO FN", "ARTIFACT SIZE"), rows,
                          right=("ARTIFACTS", "DYNAMO FN", "ARTIFACT SIZE"))
        print(table[0])
        for (info, damage), line in zip(results, table[1:]):
            print(line)
            for d in damage:
                print(f"  ! {_rel(d.path, info)}: {d.reason}")
    for p in bad_points:
        print(f"entry point {p.path}: {p.problem}")
    if damaged:
        out.note(f"{damaged} of {len(results) + len(bad_points)} damaged. A start recompiles damaged pieces by "
                 f"itself; `{out.PROG} clear HASH --yes` removes a cache.")
    return 1 if damaged else 0


def _rel(path, info: inv.CacheInfo) -> str:
    try:
        return str(path.relative_to(info.path))
    except ValueError:
        return str(path)
