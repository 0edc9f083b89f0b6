"""Our own Triton kernels' compiled files kept in the piece cache (see ops/kernel_dir.py).

Once the manager has checked its scratch directory against the index's manifest, our kernels'
first launches compile or load in `<scratch>/triton_ops`, and what they write is recorded in the
manifest at once (the pieces' index entries were committed before the model's first run). Files
there that the manifest does not name are removed first: Triton would load them unchecked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..cache import scratch
from ..ops import kernel_dir

if TYPE_CHECKING:  # pragma: no cover
    from .manager import CompilerManager

logger = logging.getLogger("atom_compile")


def attach(manager: "CompilerManager", directory: str) -> None:
    """Route our kernels' Triton files into `directory` (the manager's checked scratch)."""
    cache = manager.cache
    if cache is None or not cache.writable:
        return
    ops = Path(directory) / scratch.OPS_KERNELS_DIR
    if kernel_dir.kernel_dir() == str(ops):
        return
    try:
        removed = scratch.prune_unrecorded(cache.root, Path(directory), manager.inductor_files)
        os.makedirs(ops, mode=0o700, exist_ok=True)
    except OSError as exc:
        logger.info("atom-compile: our kernels' files stay in Triton's own cache (%s)", exc)
        return
    if removed:
        logger.info("atom-compile: removed %d unrecorded file(s) of our kernels from %s", removed, ops)

    def record() -> None:
        if cache.writable:
            cache.commit([], scratch_used=True)

    kernel_dir.use_kernel_dir(str(ops), record)
