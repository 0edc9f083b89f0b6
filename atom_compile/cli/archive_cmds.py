"""`export` and `import`: one cache to a .tar.gz and back (never imports torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cache import archive
from ..cache import inventory as inv
from ..cache.store import caches_dir
from . import output as out
from .common import hash_text, resolve_root

EXPORT_HELP = "write one cache to a .tar.gz"
EXPORT_EPILOG = """Writes the cache and the entry points that name it to a .tar.gz (verified first): the
files its indexes name, Inductor's own files included (the index records their digests), so
an import warm-starts another machine of the same environment with no compiler run.

examples:
  atom-compile-cache export ea87848f33757d9c -o llama-cpu.tar.gz
"""
IMPORT_HELP = "place the caches of an exported .tar.gz under the root"
IMPORT_EPILOG = """Every member is checked (relative, inside torch_compile_cache/<hash>/ or entrypoints/, no
links or devices, at most 8 GiB expanded) and every file an index names against its digest
before a cache of only those files is renamed into place; a cache or entry point already there
is never touched. Loading an artifact runs its code: import only archives you trust.

examples:
  atom-compile-cache import llama-cpu.tar.gz --cache-root /srv/atom
"""


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hash", metavar="HASH", type=hash_text)
    p.add_argument("-o", "--output", metavar="FILE", help="the archive (default: atom-compile-cache-HASH.tar.gz)")


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("archive", metavar="FILE", help="an archive written by export")


def run_export(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    cache_hash = inv.resolve_hash(root, args.hash)
    output = Path(args.output or f"atom-compile-cache-{cache_hash}.tar.gz")
    r = archive.export_cache(root, cache_hash, output)
    if args.json:
        out.emit(r)
        return 0
    print(f"Exported {cache_hash} to {output} ({out.size(r['bytes'])} compressed)")
    left = r["scratch_bytes"] - r["scratch_shipped"]
    left_out = (f"Inductor files {out.size(r['scratch_shipped'])} included"
                + (f", {out.size(left)} no digest covers left out" if left > 0 else ""))
    out.lines(out.fields([
        ("contents", f"{out.plural(r['artifacts'], 'artifact')}, "
                     f"{out.plural(r['dynamo_functions'], 'Dynamo function')}, "
                     f"{out.plural(r['entrypoints'], 'entry point')}"),
        ("size", f"artifacts {out.size(r['cache_bytes'])} ({left_out})"),
    ]))
    return 0


def run_import(args: argparse.Namespace) -> int:
    root = resolve_root(args)
    r = archive.import_archive(root, Path(args.archive))
    if args.json:
        out.emit({**r, "root": str(caches_dir(root))})
        return 0
    for cache_hash in r["imported"]:
        info = inv.read_cache(root, cache_hash)
        print(f"Imported {cache_hash} into {caches_dir(root)}")
        out.lines(out.fields([("contents", f"{out.contents(info)}, {out.plural(r['entrypoints'], 'entry point')}"),
                              ("size", f"artifacts {out.size(info.cache_bytes)}; " + (
                                  f"Inductor files {out.size(info.scratch_bytes)}, no compiler run on the first start"
                                  if info.scratch_bytes else "Inductor's files are rebuilt on the first start"))]))
    for cache_hash in r["present"]:
        print(f"{cache_hash} is already in {caches_dir(root)}; left as it is")
    return 0
