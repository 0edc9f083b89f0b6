"""`explain`: which key factors differ between now and each cache present (imports torch)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from ..cache import inventory as inv
from ..cache import trust
from ..cache.store import FACTORS_FILE, caches_dir
from . import output as out
from . import quiet
from .common import CliError, resolve_root
from .warm import add_model_arguments, warm_options

HELP = "say which key factors differ between now and the caches present"
EPILOG = """Compares the key factors of this environment and config (the same options as warm) with
every cache present, factor by factor; the recorded source files are re-hashed. Exit 1 if
no cache would hit.

With --compare A B it compares two caches instead, without building anything: each of A and B
is a cache hash under the root, a cache directory, or a cache_key_factors.json file (copied from
another machine, or left by another run). Exit 1 if their keys differ.

examples:
  atom-compile-cache explain
  atom-compile-cache explain tiny --compile-sizes 4 --json
  atom-compile-cache explain --compare 0123456789abcdef /mnt/other-host/cache_key_factors.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two caches' key factors (a hash under the root, a cache directory, or a "
                        f"{FACTORS_FILE}) instead of now")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "compare", None):
        return run_compare(args)
    opts = warm_options(args)
    import torch  # noqa: F401

    quiet.install(args.verbose)
    from ..cache import keys
    from .warm_job import current_factors, factors_now

    base, cfg, root = current_factors(opts)
    results = []
    for info in inv.list_caches(root):
        if info.factors is None:
            results.append({"hash": info.hash, "prefixes": info.prefixes, "hit": False,
                            "differences": [f"{FACTORS_FILE}: {info.factors_problem or 'missing'}"]})
            continue
        diff = keys.diff_factors(info.factors, factors_now(base, info.factors))
        results.append({"hash": info.hash, "prefixes": info.prefixes, "hit": not diff, "differences": diff})
    level = int(cfg.compilation_config.level)
    hit = any(r["hit"] for r in results)
    if args.json:
        out.emit({"root": str(caches_dir(root)), "level": level, "now": base, "hit": hit, "caches": results})
    else:
        out.lines(format_explain(root, base, results, level))
    return 0 if level < 2 or hit else 1


def format_explain(root: Path, base: dict, results: list[dict], level: int) -> list[str]:
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
        n = len(r["differences"])
        lines.append(f"  {name}: would miss, {n} factor{' differs' if n == 1 else 's differ'}:")
        lines += [f"    {out.ellipsis(d, 100)}" for d in r["differences"]]
    if not hit_any(results):
        lines.append("No cache would hit: the next start compiles every piece.")
    lines.append("The traced graph itself (model structure, input shapes) is compared when the model is traced.")
    return lines


def hit_any(results: list[dict]) -> bool:
    return any(r["hit"] for r in results)


def run_compare(args: argparse.Namespace) -> int:
    """Two caches' key factors, factor by factor: why a start keyed like one misses the other."""
    root = resolve_root(args)
    (a, a_name), (b, b_name) = (_factors_of(ref, root) for ref in args.compare)
    from ..cache import keys

    names = ("A", "B")
    diff = keys.diff_factors(a, b, names)
    same = keys.compute_hash(a) == keys.compute_hash(b)
    if args.json:
        out.emit({"a": a_name, "b": b_name, "same_key": same, "differences": diff})
    else:
        lines = [f"A: {a_name}", f"B: {b_name}"]
        if same:
            lines.append("Same key: a start keyed like one of them hits the other's cache.")
        else:
            n = len(diff)
            lines.append(f"Different keys, {n} factor{' differs' if n == 1 else 's differ'}:" if n else
                         "Different keys, though no factor differs (the factors files were edited?)")
            lines += [f"  {out.ellipsis(d, 100)}" for d in diff]
        out.lines(lines)
    return 0 if same else 1


def _factors_of(ref: str, root: Path) -> tuple[dict, str]:
    """The key factors a --compare argument names, and how to name it in the output."""
    if re.fullmatch(r"[0-9a-f]{16}", ref):
        path = caches_dir(root) / ref / FACTORS_FILE
        factors, problem = inv.read_json(root, path)
        if factors is None:
            raise CliError(f"--compare: cache {ref} under {caches_dir(root)}: {problem or 'no ' + FACTORS_FILE}", 2)
        return _checked(factors, ref), f"cache {ref} ({caches_dir(root)})"
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / FACTORS_FILE
    try:
        # data from another machine is only compared, never loaded: bounded, not trust-checked
        with open(path, "rb") as f:
            data = f.read(trust.MAX_JSON_BYTES + 1)
        if len(data) > trust.MAX_JSON_BYTES:
            raise ValueError(f"larger than {trust.MAX_JSON_BYTES} bytes")
        factors = trust.loads_bounded(data.decode())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CliError(f"--compare: {ref}: not a cache hash, a cache directory or a readable {FACTORS_FILE} "
                       f"({reason})", 2) from None
    return _checked(factors, ref), str(path)


def _checked(factors: Any, ref: str) -> dict:
    if not isinstance(factors, dict) or not isinstance(factors.get("config"), dict):
        raise CliError(f"--compare: {ref}: not a {FACTORS_FILE} (no config factors)", 2)
    return factors
