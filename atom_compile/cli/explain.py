"""`explain`: which key factors differ between now and each cache present (imports torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cache import inventory as inv
from ..cache.store import FACTORS_FILE, caches_dir
from . import output as out
from . import quiet
from .warm import warm_options

HELP = "say which key factors differ between now and the caches present"
EPILOG = """Compares the key factors of this environment and config (the same options as warm) with
every cache present, factor by factor; the recorded source files are re-hashed. Exit 1 if
no cache would hit.

examples:
  atom-compile-cache explain
  atom-compile-cache explain tiny --compile-sizes 4 --json
"""


def run(args: argparse.Namespace) -> int:
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
