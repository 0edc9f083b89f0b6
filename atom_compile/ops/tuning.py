"""Block shapes our kernels chose by timing, kept beside their compiled files.

The small-M linear times its block shapes at the first call of each shape above one row (the LM
head at 2-8 rows: a capture's seconds, most of them compiling candidates that lose). The choice
goes to `<kernel dir>/<kernel>.best_config` (the compiler cache's directory for our kernels,
ops/kernel_dir.py), so a restart takes it without timing or compiling the others. Like
Inductor's own `.best_config` files it is rewritten as choices are added, so the manifest holds
no digest of it (its owner and mode are checked with the directory's); it is data, never code,
and an entry is taken only if it is one of the candidates the kernel offers for that call
(anything else is ignored, and the shape is timed again).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Collection, Optional

import torch

from . import kernel_dir

logger = logging.getLogger("atom_compile")

MAX_BYTES = 1 << 20  # a table of block shapes; anything larger is not ours


def _path(kernel: str) -> Optional[Path]:
    directory = kernel_dir.kernel_dir()
    return Path(directory) / f"{kernel}.best_config" if directory else None


def _entry(key: tuple, device: torch.device) -> str:
    # the same shape may tune differently on another GPU sharing the cache directory
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([name, *(str(k) for k in key)])


def _read(path: Path) -> dict:
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        if not isinstance(table, dict):
            raise ValueError("not a JSON object")
        return table
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.info("atom-compile: ignored the tuning file %s (%s); shapes are timed again", path, exc)
        return {}


def lookup(kernel: str, key: tuple, device: torch.device, allowed: Collection[tuple]) -> Optional[tuple]:
    """The block shape saved for `key` on this device, if it is one of `allowed`; else None."""
    path = _path(kernel)
    if path is None:
        return None
    value = _read(path).get(_entry(key, device))
    if value is None:
        return None
    config = tuple(value) if isinstance(value, list) else None
    if config not in allowed:
        logger.info("atom-compile: ignored the saved block shape %r of %s for %s (not a candidate)", value,
                    kernel, key)
        return None
    return config


def remember(kernel: str, key: tuple, device: torch.device, config: tuple) -> None:
    """Save the block shape chosen for `key` (nothing without a kernel directory)."""
    path = _path(kernel)
    if path is None:
        return
    from ..cache.files import atomic_write

    table = _read(path)
    table[_entry(key, device)] = list(config)
    try:
        atomic_write(path, json.dumps(table, sort_keys=True).encode())
    except OSError as exc:  # a read-only or full cache: the next start times the shape again
        logger.info("atom-compile: could not save %s's block shape in %s (%s)", kernel, path, exc)
