"""What the last run did after its warm-up, kept next to the pieces it ran (`run_stats.json`).

A serving process that compiles a Triton kernel or autotunes after its warm-up (a shape the
warm-up missed) pays seconds on a live request; the watcher (ops/jit_watch.py) counts those
events and writes them here, per piece directory the process opened, so `inspect` can show
them after the process is gone. The file is informational: it is never loaded as code, a
damaged one reads as absent, and it is not part of any digest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from . import trust
from .files import atomic_write

logger = logging.getLogger("atom_compile")

RUN_STATS_FILE = "run_stats.json"
MAX_EVENTS = 20  # the first events of a run are kept; the count covers all of them

_active: dict[str, Path] = {}  # piece directories opened by this process


def register(path: Path) -> None:
    """Note a piece directory this process uses (its next run's statistics go there)."""
    _active[str(path)] = Path(path)


def active_paths() -> list[Path]:
    return list(_active.values())


def write(stats: dict[str, Any]) -> None:
    """Write `stats` into every piece directory this process uses; a failure is logged once
    per directory and otherwise ignored (statistics never stop a run)."""
    data = json.dumps(stats, indent=1, sort_keys=True).encode()
    for key, path in list(_active.items()):
        if not path.is_dir():  # the cache was cleared or moved since: nothing to report into
            _active.pop(key, None)
            continue
        try:
            atomic_write(path / RUN_STATS_FILE, data)
        except OSError as exc:
            logger.warning("atom-compile: cannot write %s (%s); run statistics for it stop here",
                           path / RUN_STATS_FILE, exc)
            _active.pop(key, None)


def read(root: Path, path: Path) -> Optional[dict[str, Any]]:
    """The statistics of the last run in piece directory `path` (trust-checked like every file
    the cache reads), or None when absent or unreadable."""
    try:
        text = trust.read_bytes(root, path / RUN_STATS_FILE, trust.MAX_JSON_BYTES).decode()
        stats = json.loads(text)
    except FileNotFoundError:
        return None
    except (trust.Untrusted, OSError, UnicodeDecodeError, ValueError):
        return None
    return stats if _well_formed(stats) else None


def _well_formed(stats: Any) -> bool:
    if not isinstance(stats, dict):
        return False
    count, since, events = stats.get("triton_compiles_after_warmup"), stats.get("warm_since"), stats.get("events")
    return (isinstance(count, int) and not isinstance(count, bool) and count >= 0
            and (since is None or isinstance(since, (int, float)))
            and isinstance(events, list) and all(isinstance(e, dict) for e in events))
