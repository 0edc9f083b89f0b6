"""Strict mode: a start that would compile is an error naming what missed and why.

A pre-built cache (a Docker image, a CI build step) that misses pays the whole cold compile in
production, silently. With ATOM_COMPILE_REQUIRE_CACHE=1 (or CompilationConfig.require_cache) the
first piece that would compile raises `CacheRequired` naming the piece, its shape and the key
factor that differed from the nearest cache on disk (the same comparison `explain` prints).
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn, Optional

from ..cache import inventory
from ..cache.keys import diff_factors
from ..errors import CacheRequired

HOW = ("strict mode (ATOM_COMPILE_REQUIRE_CACHE=1 or CompilationConfig.require_cache) forbids compiling at "
       "run time; warm the cache with this config (atom-compile-cache warm) or unset strict mode")


def nearest_difference(root: Optional[Path], prefix: str, factors: dict, exclude: Optional[str] = None) -> str:
    """Why no cache under `root` holds these key factors: the differing factors of the nearest
    cache made for `prefix` (or of any cache, if none was); `exclude` is this key's own hash."""
    if root is None:
        return "the cache is disabled (ATOM_COMPILE_DISABLE_CACHE)"
    caches = [c for c in inventory.list_caches(root) if c.factors is not None and c.hash != exclude]
    if not caches:
        return f"there is no cache under {root}"
    ours = [c for c in caches if prefix in c.prefixes] or caches
    diffs = sorted((diff_factors(c.factors, factors), c.hash) for c in ours)
    differences, name = diffs[0]
    if not differences:
        return f"cache {name} has the same key factors but not this piece"
    shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
    return f"the nearest cache ({name}) differs in {shown}"


def refuse(what: str, reason: str) -> NoReturn:
    raise CacheRequired(f"{what} would compile: {reason}. {HOW}.")
