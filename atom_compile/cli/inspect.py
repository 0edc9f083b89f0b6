"""`inspect`: list the caches of a root, or show one in detail (never imports torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..cache import inventory as inv
from ..cache.store import caches_dir
from . import output as out, remote_cmds
from .common import hash_text, resolve_root

HELP = "list the caches, or show one in detail"
EPILOG = """Sizes say what they include: artifacts are what the index covers (and what export ships),
Inductor files are Inductor's own generated code and libraries, rebuilt when missing.

examples:
  atom-compile-cache inspect
  atom-compile-cache inspect ea87848f33757d9c
  atom-compile-cache inspect --json | jq '.caches[].bytes'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hash", nargs="?", metavar="HASH", type=hash_text, help="show this cache in detail")
    p.add_argument("--remote", action="store_true", help="list the remote cache's entries and their signatures")
    remote_cmds.add_remote_option(p)


def run(args: argparse.Namespace) -> int:
    if args.remote:
        return remote_cmds.run_remote_listing(args, objects=False)
    root = resolve_root(args)
    points = inv.entrypoints(root)
    if args.hash:
        info = inv.read_cache(root, inv.resolve_hash(root, args.hash))
        if args.json:
            out.emit(cache_json(info, points, detail=True))
        else:
            out.lines(inspect_one(info, points))
        return 1 if any(p.problem for p in info.pieces) else 0
    caches = inv.list_caches(root)
    if args.json:
        out.emit({"root": str(caches_dir(root)), "bytes": sum(c.bytes for c in caches),
                  "caches": [cache_json(c, points, detail=False) for c in caches], "entrypoints": len(points)})
    else:
        out.lines(inspect_all(root, caches, points))
    return 0


def cache_json(info: inv.CacheInfo, points: list[inv.EntryPoint], detail: bool) -> dict[str, Any]:
    stats = [p.run_stats for p in info.pieces if p.run_stats]
    data = {
        "triton_compiles_after_warmup": sum(st["triton_compiles_after_warmup"] for st in stats)
        if stats else None,
        "hash": info.hash, "path": str(info.path), "bytes": info.bytes, "files": info.files,
        "cache_bytes": info.cache_bytes, "scratch_bytes": info.scratch_bytes,
        "prefixes": info.prefixes, "ranks": info.ranks, "entries": len(info.entries),
        "artifacts": info.artifacts, "dynamo_functions": info.dynamo_functions,
        "shapes": ["general" if s is None else s for s in info.shapes],
        "created": info.created, "created_iso": out.iso(info.created),
        "last_used": info.last_used, "last_used_iso": out.iso(info.last_used),
        "torch_version": info.torch_version, "summary": out.factor_summary(info.factors),
        "entrypoints": sum(1 for p in points if p.hash == info.hash), "problems": info.problems,
        "shared_artifacts": {prefix: len(names) for prefix, names in sorted(info.shared.items())},
    }
    if detail:
        data["factors"] = info.factors
        data["pieces"] = [{"rank": p.rank, "prefix": p.prefix, "path": str(p.path), "problem": p.problem,
                           "entries": p.entries, "dynamo_function": p.dynamo_function,
                           "run_stats": p.run_stats} for p in info.pieces]
    return data


def inspect_all(root: Path, caches: list[inv.CacheInfo], points: list[inv.EntryPoint]) -> list[str]:
    where = caches_dir(root)
    if not caches:
        return [f"No caches under {where}. `{out.PROG} warm` makes one."]
    total = sum(c.bytes for c in caches)
    lines = [f"Cache root: {where}",
             f"{out.plural(len(caches), 'cache')}, {out.size(total)}, {out.plural(len(points), 'entry point')}", ""]
    headers = ("HASH", "PREFIX", "ARTIFACTS", "DYNAMO FN", "SHAPES", "ARTIFACT SIZE", "INDUCTOR FILES", "LAST USED")
    rows = [(c.hash, ",".join(c.prefixes) or "-", c.artifacts, c.dynamo_functions, out.shapes(c.shapes),
             out.size(c.cache_bytes), out.size(c.scratch_bytes), out.when(c.last_used)) for c in caches]
    table = out.table(headers, rows, right=("ARTIFACTS", "DYNAMO FN", "ARTIFACT SIZE", "INDUCTOR FILES"))
    lines.append(table[0])
    for cache, row in zip(caches, table[1:]):
        lines.append(row)
        ranks = ",".join(map(str, cache.ranks)) or "-"
        lines.append(f"  {out.factor_summary(cache.factors)}, torch {cache.torch_version or '?'}, rank {ranks}")
        lines.extend(f"  ! {p}" for p in cache.problems)
    return lines


def inspect_one(info: inv.CacheInfo, points: list[inv.EntryPoint]) -> list[str]:
    n_points = sum(1 for p in points if p.hash == info.hash)
    lines = [f"Cache {info.hash}"]
    lines += out.fields([
        ("path", str(info.path)),
        ("size", f"{out.cache_size(info)} in {out.plural(info.files, 'file')}"),
        ("contents", f"{out.contents(info)}; {out.plural(len(info.entries), 'index entry', 'index entries')}"),
        ("shapes", out.shapes(info.shapes)),
        ("created", out.when(info.created)), ("last used", out.when(info.last_used)),
        ("torch", info.torch_version or "-"),
        ("prefixes", ", ".join(f"{p.prefix} (rank {p.rank})" for p in info.pieces) or "-"),
        ("entry points", f"{n_points} (a warm start that skips Dynamo)" if n_points else "0"),
        *_shared_field(info),
        *_after_warmup_field(info),
    ])
    lines += [f"  ! {p}" for p in info.problems]
    lines += ["", "Key factors"]
    pairs = out.flatten_factors(info.factors) if info.factors else [
        ("(none)", info.factors_problem or "no factors file")]
    lines += out.wrapped_fields(pairs)
    for piece in info.pieces:
        lines += ["", _piece_heading(piece, info.shared.get(piece.prefix, set()) if len(info.ranks) > 1 else set())]
        if piece.problem:
            continue  # the problem is listed once, above
        rows = [(e["graph_index"], "general" if e.get("runtime_shape") is None else e["runtime_shape"],
                 e["compiler"], out.size(e.get("bytes") or 0), e["sha256"][:12], e["handle"]["path"])
                for e in piece.entries]
        fn = piece.dynamo_function
        if fn:
            rows.append(("-", "-", "dynamo", out.size(fn.get("bytes") or 0), fn["sha256"][:12], fn["path"]))
        lines += out.table(("GRAPH", "SHAPE", "COMPILER", "SIZE", "SHA256", "FILE"), rows, indent="  ",
                           right=("GRAPH", "SIZE"))
    return lines


def _shared_field(info: inv.CacheInfo) -> list[tuple[str, str]]:
    """With several ranks: the pieces compiled once and stored once for all of them."""
    if len(info.ranks) < 2:
        return []
    text = ", ".join(f"{out.plural(len(names), 'artifact')} ({prefix})" for prefix, names in sorted(info.shared.items()))
    return [("shared", f"{text or 'none'}; compiled by one rank, one file on disk for ranks "
                       f"{','.join(map(str, info.ranks))}")]


def _after_warmup_field(info: inv.CacheInfo) -> list[tuple[str, str]]:
    """The last run's Triton compiles and autotunes after its warm-up (ops/jit_watch.py)."""
    stats = [p.run_stats for p in info.pieces if p.run_stats]
    if not stats:
        return []
    count = sum(st["triton_compiles_after_warmup"] for st in stats)
    since = max((st["warm_since"] or 0) for st in stats)
    events = [e for st in stats for e in st["events"]]
    text = f"{out.plural(count, 'Triton compile')} after warm-up in the last run (warm since {out.when(since)})"
    if events:
        first = events[0]
        text += f"; first: {first.get('kind')} of {first.get('kernel')} for {first.get('shapes')}"
    return [("after warm-up", text)]


def _piece_heading(piece: inv.PieceDir, shared: set[str]) -> str:
    text = f"rank_{piece.rank}/{piece.prefix}: "
    if piece.problem:
        return text + "index unusable (see above)"
    text += out.plural(len(piece.artifact_paths), "artifact")
    own = [rel for rel in piece.artifact_paths if Path(rel).name not in shared]
    if shared:
        text += f" ({len(own)} of this rank's own)"
    if piece.dynamo_function:
        text += ", 1 Dynamo function"
    return text + f" ({out.plural(len(piece.entries), 'index entry', 'index entries')})"
