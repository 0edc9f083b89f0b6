"""Where Triton keeps the compiled files of our own kernels (attention, KV write).

Inductor's kernels travel inside each piece's artifact, but ours are compiled by Triton's JIT on
their first launch, into Triton's cache (`~/.triton/cache` unless TRITON_CACHE_DIR says
otherwise). On a fresh machine or container that cache is empty, so every warm start compiled
them again and built their C launchers: most of a GPU warm start's seconds. The compiler cache
names a directory of its own (checked against its manifest before use, exported with the pieces)
and a callback that records what was written; our first launch of a specialisation compiles or
loads there. Without a directory (no cache, a read-only one) Triton's default place is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Iterator, Optional

logger = logging.getLogger("atom_compile")

_state: dict = {"dir": None, "on_written": None}


def use_kernel_dir(directory: Optional[str], on_written: Optional[Callable[[], None]] = None) -> None:
    """Compile or load our kernels' Triton files in `directory` from now on (None: Triton's own
    place); `on_written` runs after each first launch of a specialisation (it may have written)."""
    _state["dir"], _state["on_written"] = directory, on_written


def kernel_dir() -> Optional[str]:
    """The directory set by `use_kernel_dir`, or None."""
    return _state["dir"]


def _listing(directory: str) -> set[str]:
    # the names under our directory (a few dozen files: cheap next to hashing them)
    return {os.path.join(d, f) for d, _, files in os.walk(directory) for f in files}


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Around a launch that may compile: Triton's cache is our directory while it runs.

    Triton reads TRITON_CACHE_DIR each time it opens its cache (unless `triton.knobs.cache.dir`
    was set in code), so the variable is set for the launch and restored after; the C launcher
    it builds for the kernel lands there too. The callback runs only when files were added (a
    warm start, which finds them all, records nothing)."""
    directory = _state["dir"]
    if directory is None:
        yield
        return
    before = os.environ.get("TRITON_CACHE_DIR")
    files = _listing(directory)
    os.environ["TRITON_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
    callback = _state["on_written"]
    if callback is not None and _listing(directory) != files:
        try:
            callback()
        except Exception as exc:  # recording is an optimisation: the launch itself succeeded
            logger.info("atom-compile: could not record our kernels' files in %s (%s: %s)",
                        directory, type(exc).__name__, exc)


_driver_ready = False


def prepare_triton_driver() -> None:
    """Start Triton's CUDA driver with its cache in our directory, before Inductor starts it.

    The driver builds a small C module (`cuda_utils`) into Triton's cache on first use: a C
    compiler run, about 0.35 s of every warm start in a fresh HOME. Inductor's load starts the
    driver itself, so a piece's compile or load on a GPU calls this first. Once per process."""
    global _driver_ready
    if _driver_ready or _state["dir"] is None:
        return
    _driver_ready = True
    try:
        from triton.runtime import driver
    except ImportError:
        return
    with compiling():
        try:
            driver.active.get_current_device()
        except Exception as exc:  # no usable GPU driver: Inductor reports it where it matters
            logger.debug("atom-compile: Triton's driver did not start (%s: %s)", type(exc).__name__, exc)
