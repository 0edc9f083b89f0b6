"""Block shapes our kernels chose by timing, kept beside their compiled files.

The small-M linear times its block shapes at the first call of each shape above one row (the LM
head at 2-8 rows: a capture's seconds, most of them compiling candidates that lose). The choice
goes to `<kernel dir>/<kernel>.best_config` (the compiler cache's directory for our kernels,
ops/kernel_dir.py), so a restart takes it without timing or compiling the others. Like
Inductor's own `.best_config` files it is rewritten as choices are added, so the manifest holds
no digest of it (its owner and mode are checked with the directory's); it is data, never code,
and an entry is taken only if it is one of the candidates the kernel offers for that call
(anything else is ignored, and the shape is timed again).

Decode reads each weight once per step, from memory: a layer's weight is long gone from L2 by
the next step. So a shape is timed cycling through copies of its weight that together exceed
twice the L2 (`past_l2`); timed on the one weight, a layer of up to tens of MB is served from L2
and the choice favours shapes that are fast only there (BENCHMARKS.md: at 8 rows the in-L2
timing kept cuBLAS for two projections where split-K was 12-14% faster past L2). Entries carry
how they were timed (`TIMING`): a choice timed another way is timed again. A candidate may carry
a handicap for what back-to-back timing does not show (`fastest`: the library GEMM outside our
kernels' PDL chain, ops/triton_linear.py).
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
TIMING = "past-l2-chain"  # "past-l2" entries were chosen without the library's chain handicap
MAX_COPIES = 64


def _path(kernel: str) -> Optional[Path]:
    directory = kernel_dir.kernel_dir()
    return Path(directory) / f"{kernel}.best_config" if directory else None


def _entry(key: tuple, device: torch.device) -> str:
    # the same shape may tune differently on another GPU sharing the cache directory
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([name, TIMING, *(str(k) for k in key)])


def past_l2(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and as many copies as make twice the device's L2 (at most MAX_COPIES), for
    timing with the weight read from memory; the weight alone where the copies do not fit."""
    if weight.device.type != "cuda":
        return [weight]
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or (50 << 20)
    nbytes = max(1, weight.numel() * weight.element_size())
    copies = min(MAX_COPIES, -(-2 * l2 // nbytes) - 1)
    try:  # with the weight's strides (a slice of a merged weight keeps its row stride)
        return [weight, *(torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype,
                                              device=weight.device).copy_(weight) for _ in range(max(0, copies)))]
    except torch.cuda.OutOfMemoryError:  # a device filled by its KV cache: time in L2 rather than fail
        logger.info("atom-compile: no memory for %d copies of a %d-byte weight; its shapes are timed on "
                    "the one weight, which L2 may hold", copies, nbytes)
        return [weight]


def fastest(timings: dict, handicap: Optional[dict] = None) -> tuple:
    """The candidate of least time, each timing plus its `handicap` (the same unit): what a
    candidate pays in a decode step that timing it back to back does not show."""
    extra = handicap or {}
    return min(timings, key=lambda config: timings[config] + extra.get(config, 0.0))


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
