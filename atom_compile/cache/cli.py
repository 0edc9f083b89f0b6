"""`atom-compile-cache`: warm, inspect, clear, verify, explain, export and import compiler caches.

    atom-compile-cache warm                      # compile the built-in tiny Llama into the cache
    atom-compile-cache inspect                   # what is cached, how big, when last used
    atom-compile-cache clear --max-size 2G --yes # drop least recently used caches until 2 GiB fit

Human output by default, `--json` for scripts; exit 0 ok, 1 damage or a miss, 2 bad usage;
every error is one line on stderr. `inspect`, `verify`, `clear`, `export` and `import` never
import torch (they read JSON and hash files: inventory.py); `warm` and `explain` import it
when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Optional, Sequence

from ..config import ConfigError
from . import inventory as inv
from . import warm
from .store import caches_dir, cache_root

PROG = "atom-compile-cache"
_PLAIN_KEY = re.compile(r"^[A-Za-z_][\w:]*$")


class CliError(Exception):
    """One line for stderr and the exit code (1 damage or miss, 2 usage)."""

    def __init__(self, message: str, code: int = 1, where: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.where = where


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and exit code 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)", 2, where=self.prog)


# --- formatting ----------------------------------------------------------------------------


def _when(t: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _iso(t: Optional[float]) -> Optional[str]:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t)) if t else None


def _shapes(shapes: Iterable[Optional[int]]) -> str:
    return ",".join("general" if s is None else str(s) for s in shapes) or "-"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "") -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return [line(headers), *(line(r) for r in cells)]


def _plural(n: int, word: str, plural: Optional[str] = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _emit(data: Any) -> None:
    print(json.dumps(data, indent=1, sort_keys=True, default=str))


def factor_summary(factors: Optional[dict]) -> str:
    """One line of what a cache was compiled for: level, compiler, sizes, device, sources."""
    if not factors:
        return "key factors unreadable"
    cfg, env = factors.get("config") or {}, factors.get("environment") or {}
    device = " ".join(str(x) for x in (env.get("device_type"), env.get("device"), env.get("cpu_capability")) if x)
    parts = [
        f"level {cfg.get('level', '?')}",
        str(env.get("compiler") or cfg.get("compiler") or "?"),
        f"compile sizes {cfg.get('compile_sizes') or []}",
        device or "device ?",
        _plural(len(((factors.get("code") or {}).get("files") or {})), "source file"),
        _plural(len(factors.get("custom_ops") or {}), "custom op"),
    ]
    return ", ".join(parts)


def _key(name: str) -> str:
    """`.name` for a plain key, `[name]` for one with dots or slashes (a path, an Inductor option)."""
    return f".{name}" if _PLAIN_KEY.match(name) else f"[{name}]"


def flatten_factors(value: Any, prefix: str = "", collapse: int = 20) -> list[tuple[str, str]]:
    """(dotted name, value) pairs; a dict with more than `collapse` keys becomes one summary line."""
    if isinstance(value, dict) and value:
        if len(value) > collapse:
            digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
            return [(prefix, f"{len(value)} settings (sha256 {digest[:12]}; --json lists them)")]
        out = []
        for k in sorted(value, key=str):
            name = f"{prefix}{_key(str(k))}" if prefix else str(k)
            out.extend(flatten_factors(value[k], name, collapse))
        return out
    return [(prefix, value if isinstance(value, str) else json.dumps(value, default=str))]


# --- inspect -------------------------------------------------------------------------------


def _cache_json(info: inv.CacheInfo, points: list[inv.EntryPoint], detail: bool) -> dict[str, Any]:
    out = {
        "hash": info.hash, "path": str(info.path), "bytes": info.bytes, "files": info.files,
        "prefixes": info.prefixes, "ranks": info.ranks, "entries": len(info.entries),
        "shapes": ["general" if s is None else s for s in info.shapes],
        "created": info.created, "created_iso": _iso(info.created),
        "last_used": info.last_used, "last_used_iso": _iso(info.last_used),
        "torch_version": info.torch_version, "summary": factor_summary(info.factors),
        "entrypoints": sum(1 for p in points if p.hash == info.hash), "problems": info.problems,
    }
    if detail:
        out["factors"] = info.factors
        out["pieces"] = [{"rank": p.rank, "prefix": p.prefix, "path": str(p.path), "problem": p.problem,
                          "entries": p.entries, "dynamo_function": p.dynamo_function} for p in info.pieces]
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.hash:
        info = inv.read_cache(root, inv.resolve_hash(root, args.hash))
        points = inv.entrypoints(root)
        if args.json:
            _emit(_cache_json(info, points, detail=True))
        else:
            print("\n".join(_inspect_one(info, points)))
        return 1 if any(p.problem for p in info.pieces) else 0
    caches, points = inv.list_caches(root), inv.entrypoints(root)
    if args.json:
        _emit({"root": str(caches_dir(root)), "bytes": sum(c.bytes for c in caches),
               "caches": [_cache_json(c, points, detail=False) for c in caches],
               "entrypoints": len(points)})
        return 0
    print("\n".join(_inspect_all(root, caches, points)))
    return 0


def _inspect_all(root: Path, caches: list[inv.CacheInfo], points: list[inv.EntryPoint]) -> list[str]:
    where = caches_dir(root)
    if not caches:
        return [f"No caches under {where}. `{PROG} warm` makes one."]
    total = inv.format_size(sum(c.bytes for c in caches))
    lines = [f"Cache root: {where}", f"{_plural(len(caches), 'cache')}, {total}, "
             f"{_plural(len(points), 'entry point')}", ""]
    headers = ("HASH", "PREFIX", "RANKS", "ENTRIES", "SHAPES", "SIZE", "CREATED", "LAST USED", "TORCH")
    rows = [(c.hash, ",".join(c.prefixes) or "-", ",".join(map(str, c.ranks)) or "-", len(c.entries),
             _shapes(c.shapes), inv.format_size(c.bytes), _when(c.created), _when(c.last_used),
             c.torch_version or "-") for c in caches]
    table = _table(headers, rows)
    lines.append(table[0])
    for cache, row in zip(caches, table[1:]):
        lines.append(row)
        lines.append(" " * 18 + factor_summary(cache.factors))
        lines.extend(" " * 18 + f"! {p}" for p in cache.problems)
    return lines


def _inspect_one(info: inv.CacheInfo, points: list[inv.EntryPoint]) -> list[str]:
    n_points = sum(1 for p in points if p.hash == info.hash)
    lines = [f"Cache {info.hash}"]
    fields = [
        ("path", str(info.path)),
        ("size", f"{inv.format_size(info.bytes)} in {_plural(info.files, 'file')}"),
        ("created", _when(info.created)), ("last used", _when(info.last_used)),
        ("torch", info.torch_version or "-"),
        ("prefixes", ", ".join(f"{p.prefix} (rank {p.rank})" for p in info.pieces) or "-"),
        ("entries", f"{len(info.entries)}; shapes {_shapes(info.shapes)}"),
        ("entry points", f"{n_points} (a warm start that skips Dynamo)" if n_points else "0"),
    ]
    lines += [f"  {k:<13} {v}" for k, v in fields]
    lines += [f"  ! {p}" for p in info.problems]
    lines += ["", "Key factors"]
    pairs = flatten_factors(info.factors) if info.factors else [("(none)", info.factors_problem or "no factors file")]
    width = min(48, max(len(k) for k, _ in pairs))
    lines += [f"  {k:<{width}}  {v}" for k, v in pairs]
    for piece in info.pieces:
        lines += ["", _piece_heading(piece)]
        if piece.problem:
            lines.append(f"  ! index.json: {piece.problem}")
            continue
        rows = [(e["graph_index"], "general" if e.get("runtime_shape") is None else e["runtime_shape"],
                 e["compiler"], inv.format_size(e.get("bytes") or 0), e["sha256"][:12], e["handle"]["path"])
                for e in piece.entries]
        lines += _table(("GRAPH", "SHAPE", "COMPILER", "SIZE", "SHA256", "ARTIFACT"), rows, indent="  ")
    return lines


def _piece_heading(piece: inv.PieceDir) -> str:
    text = f"rank_{piece.rank}/{piece.prefix}: {_plural(len(piece.entries), 'entry', 'entries')}"
    fn = piece.dynamo_function
    if fn:
        text += f", saved Dynamo function {inv.format_size(fn.get('bytes') or 0)}"
    return text


# --- verify --------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args)
    hashes = [inv.resolve_hash(root, h) for h in args.hashes] if args.hashes else inv.cache_hashes(root)
    results = []
    for cache_hash in hashes:
        info = inv.read_cache(root, cache_hash)
        results.append((info, inv.verify_cache(info)))
    bad_points = [p for p in inv.entrypoints(root) if p.problem] if not args.hashes else []
    damaged = sum(1 for _, d in results if d) + len(bad_points)
    if args.json:
        _emit({"root": str(caches_dir(root)), "ok": damaged == 0, "caches": [
            {"hash": i.hash, "ok": not d, "files_checked": inv.verified_files(i), "bytes": i.bytes,
             "damaged": [{"path": str(x.path), "reason": x.reason} for x in d]} for i, d in results],
            "damaged_entrypoints": [{"path": str(p.path), "reason": p.problem} for p in bad_points]})
        return 1 if damaged else 0
    if not results:
        print(f"No caches under {caches_dir(root)}; nothing to verify.")
    for info, damage in results:
        state = "DAMAGED" if damage else "ok"
        print(f"{info.hash}  {state:<7}  {_plural(inv.verified_files(info), 'artifact')} checked, "
              f"{inv.format_size(info.bytes)}")
        for d in damage:
            print(f"    {d.path}: {d.reason}")
    for p in bad_points:
        print(f"entry point {p.path}: {p.problem}")
    if damaged:
        print(f"{damaged} of {len(results) + len(bad_points)} damaged. A start recompiles damaged pieces by itself; "
              f"`{PROG} clear HASH --yes` removes a cache.", file=sys.stderr)
    return 1 if damaged else 0


# --- clear ---------------------------------------------------------------------------------


def _selection(args: argparse.Namespace, root: Path) -> tuple[list[inv.CacheInfo], str]:
    """The caches to remove, least recently used first, and how they were chosen."""
    if args.hashes:
        chosen = [inv.read_cache(root, inv.resolve_hash(root, h)) for h in args.hashes]
        return chosen, "named"
    caches = inv.list_caches(root)
    if args.all:
        return caches, "all"
    if args.older_than is not None:
        if args.older_than < 0:
            raise CliError(f"--older-than: got {args.older_than}; allowed: a number of days >= 0", 2)
        return inv.select_older(caches, args.older_than), "older"
    if args.max_size is not None:
        return sorted(caches, key=lambda c: c.last_used or 0.0), "max-size"
    raise CliError("say what to clear: --all, HASH..., --older-than DAYS or --max-size SIZE", 2)


def _confirm(n: int, size: str, yes: bool) -> None:
    if yes:
        return
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError(f"refusing to remove {_plural(n, 'cache')} ({size}) without --yes (not a terminal); "
                       "add --yes, or --dry-run to list them", 2)
    answer = input(f"Remove {_plural(n, 'cache')} ({size})? [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise CliError("nothing removed", 1)


def cmd_clear(args: argparse.Namespace) -> int:
    root = _root(args)
    candidates, how = _selection(args, root)
    limit = inv.parse_size(args.max_size) if how == "max-size" else None
    planned = inv.select_lru(candidates, limit) if limit is not None else candidates
    size = inv.format_size(sum(c.bytes for c in planned))
    if args.dry_run or not planned:
        return _report_plan(planned, size, args.json, dry_run=args.dry_run)
    _confirm(len(planned), size, args.yes)
    results = _remove(root, candidates, limit)
    removed = [r for r in results if r.removed]
    gone = {r.hash for r in removed}
    if how == "all":  # dangling and unreadable entry points go too
        gone |= {p.hash for p in inv.entrypoints(root) if p.hash and not inv.hash_dir(root, p.hash).exists()}
    points = inv.remove_entrypoints(root, gone, unreadable=how == "all")
    kept = [r for r in results if not r.removed]
    if args.json:
        _emit({"removed": [r.hash for r in removed], "bytes": sum(r.bytes for r in removed),
               "kept": [{"hash": r.hash, "reason": r.reason} for r in kept], "entrypoints_removed": len(points)})
    else:
        print(f"Removed {_plural(len(removed), 'cache')} ({inv.format_size(sum(r.bytes for r in removed))}) "
              f"and {_plural(len(points), 'entry point')} from {caches_dir(root)}")
        for r in kept:
            print(f"Kept {r.hash}: {r.reason}", file=sys.stderr)
    return 1 if how == "named" and kept else 0


def _remove(root: Path, candidates: list[inv.CacheInfo], limit: Optional[int]) -> list[inv.Removal]:
    """Remove each candidate in order; with a size limit, stop once the rest fits (a cache
    kept because it is in use still counts, so the next one goes instead)."""
    total = sum(c.bytes for c in inv.list_caches(root)) if limit is not None else 0
    results = []
    for info in candidates:
        if limit is not None and total <= limit:
            break
        result = inv.remove_cache(root, info)
        results.append(result)
        if result.removed:
            total -= info.bytes
    return results


def _report_plan(planned: list[inv.CacheInfo], size: str, as_json: bool, dry_run: bool) -> int:
    if as_json:
        _emit({"dry_run": dry_run, "would_remove" if dry_run else "removed":
               [{"hash": c.hash, "bytes": c.bytes, "last_used": c.last_used} for c in planned],
               "bytes": sum(c.bytes for c in planned)})
        return 0
    if not planned:
        print("Nothing to remove.")
        return 0
    print(f"Would remove {_plural(len(planned), 'cache')} ({size}):")
    for line in _table(("HASH", "SIZE", "LAST USED"),
                       [(c.hash, inv.format_size(c.bytes), _when(c.last_used)) for c in planned], indent="  "):
        print(line)
    return 0


# --- export / import -----------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    root = _root(args)
    cache_hash = inv.resolve_hash(root, args.hash)
    output = Path(args.output or f"atom-compile-cache-{cache_hash}.tar.gz")
    result = inv.export_cache(root, cache_hash, output)
    if args.json:
        _emit(result)
    else:
        print(f"Exported {cache_hash} ({_plural(result['files'], 'file')}, "
              f"{_plural(result['entrypoints'], 'entry point')}) to {output} ({inv.format_size(result['bytes'])})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    root = _root(args)
    result = inv.import_archive(root, Path(args.archive))
    if args.json:
        _emit({**result, "root": str(caches_dir(root))})
        return 0
    for cache_hash in result["imported"]:
        print(f"Imported {cache_hash} into {caches_dir(root)}")
    for cache_hash in result["present"]:
        print(f"{cache_hash} is already in {caches_dir(root)}; left as it is")
    print(f"{_plural(result['entrypoints'], 'entry point')} placed")
    return 0


# --- warm / explain ------------------------------------------------------------------------


def _warm_options(args: argparse.Namespace) -> warm.WarmOptions:
    return warm.WarmOptions(
        model=args.model or warm.DEFAULT_MODEL,
        level=args.level,
        compile_sizes=warm.parse_sizes(args.compile_sizes, True, "--compile-sizes"),
        capture_sizes=warm.parse_sizes(args.capture_sizes, False, "--capture-sizes"),
        cudagraph_mode=args.cudagraph_mode,
        device=args.device,
        cache_dir=args.cache_root or "",
        config=args.config,
        layers=args.layers,
    )


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr)


def cmd_warm(args: argparse.Namespace) -> int:
    opts = _warm_options(args)
    _setup_logging(args.verbose)
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        report = warm.run_warm(opts).as_dict()
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        _emit(report)
    else:
        print("\n".join(format_warm(report)))
    return 0


def format_warm(r: dict[str, Any]) -> list[str]:
    """The warm summary, ccache -s style."""
    shapes = [f"general ({r['general_tokens']} tokens)", *map(str, r["compile_sizes"])]
    c = r["counters"]
    if c.get("num_dynamo_functions_loaded"):
        dynamo = "loaded: Dynamo did not run"
    elif c.get("num_dynamo_functions_saved"):
        dynamo = "saved: the next start skips Dynamo"
    else:
        dynamo = "traced (not saved)" if c.get("num_graphs_seen") else "-"
    rows = [
        ("pieces", f"{r['pieces']} compiled pieces, {r['distinct_pieces']} distinct"
                   + (f" (+{r['split_ops']} split ops run eagerly)" if r["split_ops"] else "")),
        ("shapes", ", ".join(shapes)),
        ("compiled", f"{r['compiled']} by the compiler"),
        ("loaded", f"{r['loaded']} from the cache"),
        ("reused", f"{r['deduplicated']} from identical pieces"),
        ("dynamo", dynamo),
        ("cuda graphs", _graphs_line(r)),
    ]
    for cache in r["caches"]:
        rows.append(("cache", f"{cache['path']} ({inv.format_size(cache['bytes'])} on disk)"))
    if not r["caches"]:
        rows.append(("cache", "none used" + (" (levels 0 and 1 compile nothing)" if r["level"] < 2 else "")))
    head = f"Warmed {r['model']} at level {r['level']} on {r['device']} in {r['seconds']:.1f} s"
    return [head, *(f"  {k:<12} {v}" for k, v in rows)]


def _graphs_line(r: dict[str, Any]) -> str:
    if r["cudagraphs_recorded"]:
        return f"{r['cudagraph_mode']}: recorded sizes " + ", ".join(map(str, r["cudagraphs_recorded"]))
    if r["cudagraph_mode"] == "NONE":
        return "none (cudagraph_mode NONE)"
    return f"not recorded on {r['device']}" if r["device"] != "cuda" else "none recorded"


def cmd_explain(args: argparse.Namespace) -> int:
    opts = _warm_options(args)
    _setup_logging(False)
    base, cfg, root = warm.current_factors(opts)
    from . import keys  # torch: explain may import it

    results = []
    for info in inv.list_caches(root):
        if info.factors is None:
            results.append({"hash": info.hash, "prefixes": info.prefixes, "hit": False,
                            "differences": [f"{inv.FACTORS_FILE}: {info.factors_problem or 'missing'}"]})
            continue
        now = warm.factors_now(base, info.factors)
        diff = keys.diff_factors(info.factors, now)
        results.append({"hash": info.hash, "prefixes": info.prefixes, "hit": not diff, "differences": diff})
    level = int(cfg.compilation_config.level)
    hit = any(r["hit"] for r in results)
    if args.json:
        _emit({"root": str(caches_dir(root)), "level": level, "now": base, "hit": hit, "caches": results})
    else:
        print("\n".join(_format_explain(root, base, results, level)))
    if level < 2:
        return 0
    return 0 if hit else 1


def _format_explain(root: Path, base: dict, results: list[dict], level: int) -> list[str]:
    cfg, env = base["config"], base["environment"]
    lines = [f"Now: level {cfg['level']}, {env.get('compiler')}, compile sizes {cfg['compile_sizes']}, "
             f"{env.get('device_type')} {env.get('device')}, torch {env.get('torch')}"]
    if level < 2:
        lines.append(f"Level {level} compiles nothing, so no cache is read or written.")
    if not results:
        return lines + [f"No caches under {caches_dir(root)}: the first start compiles every piece."]
    lines.append(f"Caches under {caches_dir(root)}:")
    for r in sorted(results, key=lambda r: not r["hit"]):
        name = f"{r['hash']} ({','.join(r['prefixes']) or '-'})"
        if r["hit"]:
            lines.append(f"  {name}: would hit (config, environment, traced sources and custom ops unchanged)")
            continue
        lines.append(f"  {name}: would miss, {_plural(len(r['differences']), 'factor')} differ:")
        lines += [f"      {d}" for d in r["differences"]]
    if not any(r["hit"] for r in results):
        lines.append("No cache would hit: the next start compiles every piece.")
    lines.append("The traced graph itself (model structure, input shapes) is compared when the model is traced.")
    return lines


# --- the parser ----------------------------------------------------------------------------


def _root(args: argparse.Namespace) -> Path:
    return cache_root(args.cache_root or "")


def _hash_text(text: str) -> str:
    value = text.strip().lower()
    if not (4 <= len(value) <= 16 and all(c in "0123456789abcdef" for c in value)):
        raise argparse.ArgumentTypeError(f"bad cache hash {text!r}: expected 16 hex digits (or a unique prefix)")
    return value


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--cache-root", metavar="DIR",
                   help="the cache root (default: $ATOM_COMPILE_CACHE_ROOT, else $XDG_CACHE_HOME/atom or ~/.cache/atom)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("model", nargs="?", metavar="MODEL", default=warm.DEFAULT_MODEL,
                   help="a preset (tiny, llama-3.2-1b) or package.module:factory (default: tiny)")
    p.add_argument("--level", metavar="N", help="compilation level 0-3 or its name (default 3, PIECEWISE)")
    p.add_argument("--compile-sizes", nargs="+", metavar="SIZE",
                   help="token counts to compile a concrete entry for; 'cudagraph_capture_sizes' adds every capture size")
    p.add_argument("--capture-sizes", nargs="+", metavar="SIZE", help="CUDA-graph capture sizes (batch sizes)")
    p.add_argument("--cudagraph-mode", metavar="M", help="NONE, TR_HYBRID (PIECEWISE), FULL, FULL_DECODE_ONLY, "
                   "FULL_AND_TR_HYBRID")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs (default cpu)")
    p.add_argument("--cache-dir", dest="cache_root", metavar="DIR", help="the same as --cache-root")
    p.add_argument("--config", metavar="JSON", help="a Config as JSON (or @file.json); the options above win")
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers of a built-in preset")
    return p


_FACTORY_HELP = """\
MODEL is a built-in preset (tiny, llama-3.2-1b; random weights) or package.module:factory.
The factory is called as factory(config) with an atom_compile.Config, inside
set_current_config(config), and returns a model or (model, example_inputs) where
example_inputs(num_tokens) returns the positional arguments of one forward. Without
example_inputs the model is called as model(input_ids, positions); a model with
no_compile_layers and allocate_kv_cache (like the built-in Llama) is driven with a paged KV
cache. A model without a @support_torch_compile part is compiled with
torch.compile(model, backend=atom_compile.backend(config)). The working directory is on the
import path.
"""

_EPILOGS = {
    "warm": _FACTORY_HELP + """
The first call traces the general shape (the largest capture size worth of tokens, at least 8)
and compiles (or loads) every piece; then one call per compile size compiles each concrete
entry. On CUDA the capture sizes are recorded as CUDA graphs. A second warm of the same model
compiles nothing.

examples:
  atom-compile-cache warm
  atom-compile-cache warm tiny --layers 4 --compile-sizes 1 2 4 8 --json
  atom-compile-cache warm llama-3.2-1b --device cuda --capture-sizes 1 2 4 8 --compile-sizes cudagraph_capture_sizes
  atom-compile-cache warm mypkg.models:build --config '{"max_num_seqs": 64}'
""",
    "inspect": """examples:
  atom-compile-cache inspect
  atom-compile-cache inspect ea87848f33757d9c
  atom-compile-cache inspect --json | jq '.caches[].bytes'
""",
    "clear": """Removes whole caches (and the entry points that name them). A cache that a running process
uses is never removed: it is skipped and named. Without --yes, clear asks on a terminal and
refuses in a script.

examples:
  atom-compile-cache clear --max-size 2G --yes
  atom-compile-cache clear --older-than 30 --dry-run
  atom-compile-cache clear ea87848f33757d9c --yes
""",
    "verify": """Checks every artifact and saved Dynamo function against the sha256 its index recorded,
and that every index parses. Exit 1 (with the damaged files listed) on damage.

examples:
  atom-compile-cache verify
  atom-compile-cache verify ea87848f33757d9c --json
""",
    "explain": """Compares the key factors of this environment and config (the same options as warm) with
every cache present, factor by factor; the recorded source files are re-hashed. Exit 1 if
no cache would hit.

examples:
  atom-compile-cache explain
  atom-compile-cache explain tiny --compile-sizes 4 --json
""",
    "export": """Writes the cache and the entry points that name it to a .tar.gz (verified first).

examples:
  atom-compile-cache export ea87848f33757d9c -o llama-cpu.tar.gz
""",
    "import": """Every member is checked (relative, inside torch_compile_cache/<hash>/ or entrypoints/, no
links or devices) and every artifact against its index before the cache is renamed into
place. Loading an artifact runs its code: import only archives you trust.

examples:
  atom-compile-cache import llama-cpu.tar.gz --cache-root /srv/atom
""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Warm, inspect and manage atom-compile compiler caches.",
                     epilog=f"examples:\n  {PROG} warm\n  {PROG} inspect\n  {PROG} clear --max-size 2G --yes\n\n"
                            f"`{PROG} COMMAND --help` for each command.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common, model = _common(), _model_options()

    def add(name: str, func: Callable[[argparse.Namespace], int], help_text: str,
            parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EPILOGS[name],
                           parents=[*parents, common], formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = add("warm", cmd_warm, "compile a model's every piece into the cache", [model])
    p.add_argument("-v", "--verbose", action="store_true", help="atom-compile's log (and tracebacks) on stderr")
    p = add("inspect", cmd_inspect, "list the caches, or show one in detail")
    p.add_argument("hash", nargs="?", metavar="HASH", type=_hash_text, help="show this cache in detail")
    p = add("clear", cmd_clear, "remove caches")
    p.add_argument("hashes", nargs="*", metavar="HASH", type=_hash_text, help="remove these caches")
    p.add_argument("--all", action="store_true", help="remove every cache")
    p.add_argument("--older-than", type=float, metavar="DAYS", help="remove caches not used for DAYS days")
    p.add_argument("--max-size", metavar="SIZE", help="remove least recently used caches until the rest fits (2G, 500M)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    p = add("verify", cmd_verify, "check every artifact against its recorded sha256")
    p.add_argument("hashes", nargs="*", metavar="HASH", type=_hash_text, help="verify these caches (default: all)")
    add("explain", cmd_explain, "say which key factors differ between now and the caches present", [model])
    p = add("export", cmd_export, "write one cache to a .tar.gz")
    p.add_argument("hash", metavar="HASH", type=_hash_text)
    p.add_argument("-o", "--output", metavar="FILE", help="the archive (default: atom-compile-cache-HASH.tar.gz)")
    p = add("import", cmd_import, "place the caches of an exported .tar.gz under the root")
    p.add_argument("archive", metavar="FILE", help="an archive written by export")
    return parser


def _check_selection(args: argparse.Namespace) -> None:
    if args.command == "clear":
        chosen = [bool(args.hashes), args.all, args.older_than is not None, args.max_size is not None]
        if sum(chosen) > 1:
            raise CliError("give one of --all, HASH..., --older-than or --max-size", 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script. Returns the exit code; never raises for bad input or damage."""
    parser = build_parser()
    command, verbose = "?", False
    try:
        args = parser.parse_args(argv)
        command, verbose = args.command or "?", getattr(args, "verbose", False)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        _check_selection(args)
        return args.func(args)
    except CliError as exc:
        return _fail(command, str(exc), exc.code, exc.where)
    except inv.InventoryError as exc:
        return _fail(command, str(exc), exc.exit_code)
    except warm.WarmError as exc:
        return _fail(command, str(exc), exc.exit_code)
    except ConfigError as exc:
        return _fail(command, str(exc), 2)
    except KeyboardInterrupt:
        return _fail(command, "interrupted", 130)
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a compile or an OS failure: one line, the traceback on request
        if verbose:
            traceback.print_exc()
        hint = "" if command != "warm" else " (rerun with --verbose for the traceback)"
        return _fail(command, f"{type(exc).__name__}: {exc}".splitlines()[0] + hint, 1)


def _fail(command: str, message: str, code: int, where: Optional[str] = None) -> int:
    """Print the error as one line (a multi-line message is joined) and return `code`."""
    where = where or (f"{PROG} {command}" if command != "?" else PROG)
    text = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"{where}: error: {text}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
