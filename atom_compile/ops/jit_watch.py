"""Triton compiles and autotuning after warm-up: one warning per kernel and shape, counted.

A serving process should compile nothing once it has warmed up; a Triton kernel compiled or
autotuned on a live request (a shape the warm-up missed) costs that request seconds. After
`mark_warmed_up()` (the ModelRunner calls it when its capture ends; an engine that warms up its
own way calls it itself) every such event is counted (`num_triton_compiles_after_warmup`),
logged once per kernel and shape, and written to `run_stats.json` in each piece directory the
process uses, for `inspect`. Sources:
- Triton's JIT (`knobs.runtime.jit_post_compile_hook`, chained after a hook set before ours):
  any `@triton.jit` kernel compiled for a new specialisation, ours and anyone's. The shapes
  come from the launch that asked when it says (`launching`, used by FastLaunch), else from
  the specialisation Triton reports.
- Inductor's runtime autotuning (`CachingAutotuner.autotune_to_one_config`): a generated kernel
  picking its configuration on its first call.
Nothing is installed before the first `mark_warmed_up()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from typing import Any, Iterator, Optional

import torch

from ..cache import run_stats
from ..counters import compilation_counter

logger = logging.getLogger("atom_compile")

_launch: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("atom_jit_launch", default=None)
_state: dict[str, Any] = {"warm": False, "since": None, "count": 0, "events": [], "seen": set()}
_installed: set[str] = set()


def mark_warmed_up() -> None:
    """From now on, a Triton compile or an Inductor autotune is a miss of the warm-up: count
    it and warn once per kernel and shape. Calling it again starts a new count."""
    _install()
    _state.update(warm=True, since=time.time(), count=0, events=[], seen=set())
    run_stats.write(_snapshot())


def stop_watching() -> None:
    """Back to before warm-up (a new warm-up phase, such as loading another model, follows)."""
    _state.update(warm=False, since=None, count=0, events=[], seen=set())


def is_warm() -> bool:
    return bool(_state["warm"])


def describe(args: Any) -> str:
    """Launch arguments in a line: tensors as shape and dtype, scalars as values."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}")
        elif isinstance(a, (int, float, bool)):
            parts.append(repr(a))
    return ", ".join(parts)


@contextlib.contextmanager
def launching(args: tuple) -> Iterator[None]:
    """Around a launch that may compile: a compile it causes is reported with these shapes."""
    token = _launch.set(describe(args) if _state["warm"] else None)
    try:
        yield
    finally:
        _launch.reset(token)


def report(kind: str, kernel: str, shapes: str) -> None:
    """One compile or autotune event (ignored before warm-up)."""
    if not _state["warm"]:
        return
    compilation_counter.num_triton_compiles_after_warmup += 1
    _state["count"] += 1
    if (kind, kernel, shapes) not in _state["seen"]:
        _state["seen"].add((kind, kernel, shapes))
        logger.warning("atom-compile: %s of %s after warm-up, for %s: a shape the warm-up missed "
                       "(add it to the warm-up, compile_sizes or the capture sizes)", kind, kernel, shapes or "?")
    if len(_state["events"]) < run_stats.MAX_EVENTS:
        _state["events"].append({"kind": kind, "kernel": kernel, "shapes": shapes, "at": time.time()})
    run_stats.write(_snapshot())


def _snapshot() -> dict[str, Any]:
    return {"warm_since": _state["since"], "triton_compiles_after_warmup": _state["count"],
            "events": list(_state["events"])}


def _install() -> None:
    if "triton" not in _installed:
        _installed.add("triton")
        _watch_triton_jit()
    if "inductor" not in _installed:
        _installed.add("inductor")
        _watch_inductor_autotune()


def _watch_triton_jit() -> None:
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs (< 3.4): its JIT is not watched
        logger.debug("atom-compile: Triton's JIT hooks are not available; JIT compiles after warm-up are not watched")
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Optional[bool]:
        result = previous(**kwargs) if previous is not None else None
        if not kwargs.get("is_manual_warmup"):
            fn = kwargs.get("fn")
            name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
            report("Triton JIT compile", name, _launch.get() or str(kwargs.get("repr", "")))
        return result

    knobs.runtime.jit_post_compile_hook = hook


def _watch_inductor_autotune() -> None:
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError:
        return
    cls = getattr(triton_heuristics, "CachingAutotuner", None)
    original = getattr(cls, "autotune_to_one_config", None)
    if original is None:
        return

    def autotune_to_one_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(getattr(self, "fn", None), "__name__", None) or type(self).__name__
        report("Inductor autotuning", name, describe(args))
        return original(self, *args, **kwargs)

    cls.autotune_to_one_config = autotune_to_one_config
