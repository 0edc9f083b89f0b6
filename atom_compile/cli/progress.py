"""What `warm` shows while it works, on stderr: a tqdm bar on a terminal, plain lines otherwise.

The per-piece numbers come from `compilation_counter`, polled by a small thread while a step
runs (the compiler needs no hook for it): pieces compiled, loaded from the cache and reused,
and the size of the caches this process opened.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..cache.inventory import disk_usage
from ..cache.store import current_rank, open_cache_paths
from ..counters import compilation_counter
from .output import PROG, plural, size

POLL_SECONDS = 0.25


def counts(before: dict[str, int]) -> dict[str, int]:
    """compiled / loaded / reused pieces and recorded graphs since `before`."""
    now = compilation_counter.as_dict()
    d = {k: v - before.get(k, 0) for k, v in now.items()}
    return {"compiled": d["num_inductor_compiles"] + d["num_eager_compiles"],
            "loaded": d["num_compiled_artifacts_loaded"], "reused": d["num_deduplicated_pieces"],
            "graphs": d["num_cudagraph_captured"]}


def describe(c: dict[str, int]) -> str:
    text = f"{c['compiled']} compiled, {c['loaded']} loaded, {c['reused']} reused"
    cache = sum(disk_usage(Path(p))[0] for p in open_cache_paths())
    if cache:
        text += f", cache {size(cache)}"
    if c["graphs"]:
        text += f", {plural(c['graphs'], 'CUDA graph')} recorded"
    return text


class Progress:
    """`with Progress(total) as p: ...; p.step(label, fn)` runs `fn` as one step and reports what
    that step did."""

    def __init__(self, total: int, show: Optional[bool] = None):
        self.total = total
        self.show = (current_rank() == 0) if show is None else show
        self.tty = self.show and sys.stderr.isatty()
        self.done = 0
        self.before = compilation_counter.as_dict()
        self.bar: Any = None

    def __enter__(self) -> "Progress":
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=f"{PROG} warm", unit="step", leave=False, file=sys.stderr)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    def step(self, label: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        self.before = compilation_counter.as_dict()
        stop = threading.Event()
        poller = threading.Thread(target=self._poll, args=(label, stop), daemon=True) if self.bar else None
        if poller:
            poller.start()
        try:
            return fn()
        finally:
            stop.set()
            if poller:
                poller.join()
            self.done += 1
            self._report(label, time.perf_counter() - start)

    def _poll(self, label: str, stop: threading.Event) -> None:
        while not stop.wait(POLL_SECONDS):
            self.bar.set_postfix_str(f"{label}: {describe(counts(self.before))}", refresh=True)

    def _report(self, label: str, seconds: float) -> None:
        if not self.show:
            return
        text = f"{label}: {describe(counts(self.before))} ({seconds:.1f} s)"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"{PROG}: [{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)
